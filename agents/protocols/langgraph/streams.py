"""A run's answers that wait: its Server-Sent Events (`agents.protocols.messages.RunStream`
over `scheduling.live.follow`), and the final values ``wait`` and ``join`` answer on the
event loop (`agents.protocols.common.DeferredResponse`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from typing import Any
from urllib.parse import urlencode

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse

from agents import services
from agents.protocols import common
from agents.protocols.langgraph.assistants import assistant_uuid
from agents.protocols.langgraph.state import bound_graph, build_thread
from agents.protocols.messages import ENDINGS, INTERACTION, RunStream, parse_event_id
from scheduling import live
from scheduling.models import TERMINAL_STATUSES, Event, Run, RunStatus, Session


def locations(response: HttpResponse, run: Run, tail: str) -> HttpResponse:
    """``Content-Location`` (the run) and ``Location`` (where the SDK reconnects: a stream
    keeps its modes there, as the SDK sends no parameters when it reconnects), relative to
    the API's root as a LangGraph server's are."""
    base = f"/threads/{run.session_id}/runs/{run.pk}"
    response["Content-Location"] = base
    response["Location"] = f"{base}/{tail}"
    return response


def stream_location(modes: Iterable[str]) -> str:
    """Where a stream of ``modes`` reconnects, relative to the run."""
    return "stream?" + urlencode([("stream_mode", mode) for mode in modes])


def _still_waiting(run_id: Any, interaction_id: Any) -> bool:
    return Run.objects.filter(
        pk=run_id, status=RunStatus.SUSPENDED, interaction__id=interaction_id
    ).exists()


def _cancel_run(run_id: Any) -> None:
    run = Run.objects.filter(pk=run_id).first()
    if run is not None:
        services.run_cancel(run=run)


def finished(run: Run) -> bool:
    """Whether ``run`` has nothing more to do until someone answers it."""
    return run.status in TERMINAL_STATUSES or run.status == RunStatus.SUSPENDED


async def _sse(
    session_id: Any,
    stream: RunStream,
    *,
    seconds: float,
    cancel_on_disconnect: bool,
) -> AsyncIterator[bytes]:
    """A run's Server-Sent Events (`RunStream`) from `scheduling.live.follow`, for
    ``seconds`` at most (then the SDK reconnects with ``Last-Event-ID``); ends after its
    ``end`` or ``error``. A client that disconnects before cancels the run when it asked
    (``on_disconnect="cancel"``)."""
    still_waiting = sync_to_async(_still_waiting, thread_sensitive=False)
    run_id = stream.run
    done = False
    try:
        for part in stream.opening():
            yield part.encode()
        after = stream.thread.last_seq
        async with contextlib.aclosing(live.follow(session_id, after, seconds)) as items:
            async for item in items:
                if isinstance(item, live.Delta):
                    if item.run == run_id:
                        for part in stream.delta(item.type, item.payload):
                            yield part.encode()
                elif isinstance(item, live.Dropped):
                    stream.dropped()
                elif isinstance(item, live.KeepAlive):
                    yield b": keep-alive\n\n"
                else:
                    for part in stream.durable(item):
                        yield part.encode()
                    closing = stream.closing(item)
                    if closing is None:
                        continue
                    if item.type == INTERACTION and not await still_waiting(
                        run_id, item.payload.get("id")
                    ):
                        continue  # answered since: the run goes on
                    done = True
                    yield closing.encode()
                    return
    except asyncio.CancelledError:
        if cancel_on_disconnect and not done:
            cancel = sync_to_async(_cancel_run, thread_sensitive=False)
            await asyncio.shield(cancel(run_id))
        raise


def stream_response(
    session: Session,
    run: Run,
    after: int,
    modes: Iterable[str],
    *,
    last_event_id: str | None = None,
    live_start: bool = True,
    cancel_on_disconnect: bool = False,
) -> StreamingHttpResponse:
    """The run's event stream from seq ``after`` (or where ``last_event_id`` says)."""
    resume = parse_event_id(last_event_id)
    start = resume.seq if resume is not None else after
    thread = build_thread(session, upto=start)
    graph = bound_graph(session)
    meta = {
        "thread_id": str(session.pk),
        "graph_id": graph,
        "assistant_id": assistant_uuid(graph) if graph else None,
    }
    stream = RunStream(thread, str(run.pk), modes, meta, resume=resume, live=live_start)
    seconds = settings.SAGE.get("SAGE_LANGGRAPH_STREAM_SECONDS") or 300
    response = StreamingHttpResponse(
        _sse(session.pk, stream, seconds=seconds, cancel_on_disconnect=cancel_on_disconnect),
        content_type="text/event-stream",
    )
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return locations(response, run, stream_location(modes))


# How often a waiting answer reads its run's status when no event says it ended (a run
# rolled back leaves no terminal event: its events are removed).
WAIT_CHECK_SECONDS = 2.0


async def until_finished(run: Run) -> None:
    """Wait (`scheduling.live.follow`) until ``run`` ends or waits for its interaction."""
    reload = sync_to_async(lambda: Run.objects.filter(pk=run.pk).first(), thread_sensitive=False)
    after = await sync_to_async(common.run_start, thread_sensitive=False)(run)
    while True:
        current = await reload()
        if current is None or finished(current):
            return
        window = live.follow(run.session_id, after, WAIT_CHECK_SECONDS)
        async with contextlib.aclosing(window) as items:
            async for item in items:
                if isinstance(item, Event):
                    after = item.seq
                    ends = item.type in ENDINGS or item.type == INTERACTION
                    if ends and str(item.run_id) == str(run.pk):
                        break


def _final_values(session_id: Any, run_id: Any) -> dict[str, Any]:
    """What ``wait`` and ``join`` answer: the thread's values when the run ended (with
    ``__interrupt__`` while it waits for its interaction), ``__error__`` when it failed."""
    run = Run.objects.get(pk=run_id)
    session = Session.objects.get(pk=session_id)
    if run.status == RunStatus.FAILED:
        error = run.error or {}
        return {"__error__": {"error": error.get("code"), "message": error.get("message")}}
    thread = build_thread(session)
    values = thread.values
    if run.status == RunStatus.SUSPENDED and thread.interrupts:
        values = {**values, "__interrupt__": thread.interrupts}
    return values


def wait_response(run: Run, tail: str) -> HttpResponse:
    """An answer that waits for ``run`` on the event loop (`common.DeferredResponse`)."""

    async def compute() -> HttpResponse:
        await until_finished(run)
        values = await sync_to_async(_final_values, thread_sensitive=False)(run.session_id, run.pk)
        return JsonResponse(values, safe=False)

    return locations(common.DeferredResponse(compute), run, tail)


def last_seq(run: Run) -> int:
    last = (
        Event.objects.filter(session_id=run.session_id, run=run)
        .order_by("-seq")
        .values_list("seq", flat=True)
        .first()
    )
    return last or 0


def ended(run: Run) -> StreamingHttpResponse:
    """The stream of a run that has nothing more to say: its ``end``."""

    async def parts() -> AsyncIterator[bytes]:
        seq = await sync_to_async(last_seq, thread_sensitive=False)(run)
        yield f"id: {seq}-15\nevent: end\ndata: null\n\n".encode()

    response = StreamingHttpResponse(parts(), content_type="text/event-stream")
    return locations(response, run, "stream")
