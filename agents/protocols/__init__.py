"""The protocols other clients already speak, as thin layers over the services every door
calls: the LangGraph server API under ``/lg/`` (`agents.protocols.langgraph`) and the
OpenAI-compatible API under ``/v1/``. What they share (the assistants a user may run, a
message's text) is in `agents.protocols.common`."""
