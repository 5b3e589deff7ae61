"""Remote MCP servers as agent tools (issue 34): naming, transport, sessions, tools.

Django-free except `credentials` (the user's saved connections, read in a thread).
"""
