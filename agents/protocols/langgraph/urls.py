"""The ``/lg/`` routes (a client is given ``http://HOST:PORT/lg``)."""

from __future__ import annotations

from django.urls import path

from agents.protocols.langgraph.assistants import (
    AssistantCount,
    AssistantDetail,
    AssistantSearch,
    Info,
    Ok,
)
from agents.protocols.langgraph.runs import (
    RunCancel,
    RunCreate,
    RunDetail,
    RunJoin,
    RunJoinStream,
    RunStreamView,
    RunWait,
    ThreadRuns,
)
from agents.protocols.langgraph.state import ThreadHistory, ThreadState
from agents.protocols.langgraph.threads import ThreadCount, ThreadDetail, Threads, ThreadSearch

THREAD = "threads/<uuid:thread_id>"
RUN = f"{THREAD}/runs/<uuid:run_id>"
urlpatterns = [
    path("info", Info.as_view()),
    path("ok", Ok.as_view()),
    path("assistants/search", AssistantSearch.as_view()),
    path("assistants/count", AssistantCount.as_view()),
    path("assistants/<path:assistant_id>/graph", AssistantDetail.as_view(), {"part": "graph"}),
    path("assistants/<path:assistant_id>/schemas", AssistantDetail.as_view(), {"part": "schemas"}),
    path(
        "assistants/<path:assistant_id>/subgraphs", AssistantDetail.as_view(), {"part": "subgraphs"}
    ),
    path("assistants/<path:assistant_id>", AssistantDetail.as_view()),
    path("threads", Threads.as_view()),
    path("threads/search", ThreadSearch.as_view()),
    path("threads/count", ThreadCount.as_view()),
    path(THREAD, ThreadDetail.as_view()),
    path(f"{THREAD}/state", ThreadState.as_view()),
    path(f"{THREAD}/state/checkpoint", ThreadState.as_view()),
    path(f"{THREAD}/state/<str:checkpoint>", ThreadState.as_view()),
    path(f"{THREAD}/history", ThreadHistory.as_view()),
    path(f"{THREAD}/runs", ThreadRuns.as_view()),
    path(f"{THREAD}/runs/stream", RunStreamView.as_view()),
    path(f"{THREAD}/runs/wait", RunWait.as_view()),
    path(RUN, RunDetail.as_view()),
    path(f"{RUN}/join", RunJoin.as_view()),
    path(f"{RUN}/stream", RunJoinStream.as_view()),
    path(f"{RUN}/cancel", RunCancel.as_view()),
    path("runs", RunCreate.as_view()),
    path("runs/stream", RunStreamView.as_view()),
    path("runs/wait", RunWait.as_view()),
]
