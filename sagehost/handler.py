"""The web process's ASGI handler: each request's middleware and view run on a pool thread.

Django's own ASGI handler runs the middleware chain on the event loop, and every
``MiddlewareMixin`` middleware (sessions, CSRF, authentication, …) hops twice per request
into the one thread Django keeps for thread-sensitive code, as does every sync view: a web
process then handles its requests one at a time on that thread, paying a dozen thread
hops each. Here the whole chain is synchronous and one request is one hop onto a thread of
a pool (`request_threads`), so a process serves that many requests at once, each as it
would under WSGI (its thread's database connection is given back after the request).

A streaming response whose content is an asynchronous iterator (the session event stream)
is still sent from the event loop: the view only builds it on its thread.

Request bodies are bounded here, before any of them is stored: a ``Content-Length`` above
``DATA_UPLOAD_MAX_MEMORY_SIZE`` (``SAGE_MAX_REQUEST_BYTES``) is answered 413 unread, and a
chunked body (no ``Content-Length``) is read until it passes the limit, then answered 413
too. A chunked body within the limit is given the ``Content-Length`` it turned out to have:
DRF reads a request without one as having no body.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.base import BaseHandler
from django.db import close_old_connections
from django.http import HttpRequest, HttpResponseBase, JsonResponse

# Threads per CPU of a web process: a request spends about half its time waiting for the
# database, so a few per CPU keep the CPUs busy; more only contend for the GIL
# (docs/PERFORMANCE.md).
THREADS_PER_CPU = 4


def request_threads() -> int:
    """Threads serving requests in one web process: `THREADS_PER_CPU` per CPU, and never
    more than the database connection pool holds (a request never waits for one)."""
    threads = THREADS_PER_CPU * (os.cpu_count() or 1)
    pool = settings.DATABASES["default"].get("OPTIONS", {}).get("pool")
    if isinstance(pool, dict) and pool.get("max_size"):
        threads = min(threads, int(pool["max_size"]))
    return max(2, threads)


class ThreadedASGIHandler(ASGIHandler):
    """Django's ASGI handler with the middleware chain and view run synchronously on a
    thread pool (see the module text)."""

    def __init__(self) -> None:
        BaseHandler.__init__(self)
        self.load_middleware(is_async=False)
        self.threads = request_threads()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="sage-web")
        from sagehost.express import Express  # it needs the apps loaded

        self.express = Express.configured()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """As Django's, without a ``ThreadSensitiveContext`` per request: that context
        starts (and joins) a thread of its own for the request's few thread-sensitive
        calls (the request signals, closing the response), which here share asgiref's
        one thread instead; the request's own work is on the pool."""
        if scope["type"] != "http":
            raise ValueError(f"only HTTP connections are served, not {scope['type']}")
        await self.handle(scope, receive, send)

    async def get_response_async(self, request: HttpRequest) -> HttpResponseBase:
        response = await sync_to_async(self._respond, thread_sensitive=False, executor=self._pool)(
            request
        )
        # A response that waits for something (a run's end: `agents.protocols.common.
        # DeferredResponse`) settles on the event loop before its status line is sent, so
        # its status is the real one and no request thread waits.
        settle = getattr(response, "settle", None)
        if settle is not None:
            await settle()
        return response

    def _respond(self, request: HttpRequest) -> HttpResponseBase:
        try:
            return self.get_response(request)
        finally:
            close_old_connections()

    async def handle(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Django's, with the body bounded (see the module text), and a request the
        express lane takes answered there (`sagehost.express`)."""
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        declared = _content_length(scope)
        if limit is not None and declared is not None and declared > limit:
            await self._too_large(send)  # unread: a client that sent Expect waits no more
            return
        try:
            route = self.express.route(scope) if self.express is not None else None
            if route is not None:
                receive = await self._express(route, scope, receive, send)
                if receive is None:
                    return
            await super().handle(scope, receive, send)
        except _BodyTooLarge:
            await self._too_large(send)

    async def _express(self, route: Any, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        """Answer the request on the express lane; None when answered, else what the full
        stack reads the request (the body already read) from."""
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return None
        with closing(body_file):
            request, _error = self.create_request(scope, body_file)
            if request is not None:
                # Straight onto the pool: asgiref's `sync_to_async` wrapper (built per call,
                # thread-sensitivity checks, contextvars carried back) cost this lane a third
                # of its event-loop time, for nothing the lane uses.
                response = await asyncio.get_running_loop().run_in_executor(
                    self._pool, contextvars.copy_context().run, self.express.answer, route, request
                )
                if response is not None:
                    await self._send_whole(response, send)
                    return None
            # The lane may have read the body (Django closes the file then): its bytes.
            body = getattr(request, "_body", None)
            if body is None:
                body_file.seek(0)
                body = body_file.read()
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return replay

    async def _send_whole(self, response: HttpResponseBase, send: Any) -> None:
        """A whole (not streaming) response in two messages: Django's `send_response`,
        without its chunking generator."""
        if response.streaming or response.cookies:
            await self.send_response(response, send)
            return
        headers = [
            (name.encode("ascii"), value.encode("latin1")) for name, value in response.items()
        ]
        await send(
            {"type": "http.response.start", "status": response.status_code, "headers": headers}
        )
        await send({"type": "http.response.body", "body": response.content})

    async def read_body(self, receive: Any) -> Any:
        """As Django's, refusing (``_BodyTooLarge``) a body that grows past the limit
        before more of it is stored."""
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        body_file = tempfile.SpooledTemporaryFile(
            max_size=settings.FILE_UPLOAD_MAX_MEMORY_SIZE, mode="w+b"
        )
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                body_file.close()
                raise RequestAborted()
            chunk = message.get("body", b"")
            size += len(chunk)
            if limit is not None and size > limit:
                body_file.close()
                raise _BodyTooLarge
            if chunk:
                if getattr(body_file, "_rolled", False):
                    await sync_to_async(body_file.write, thread_sensitive=False)(chunk)
                else:
                    body_file.write(chunk)
            if not message.get("more_body", False):
                break
        body_file.seek(0)
        return body_file

    def create_request(self, scope: dict[str, Any], body_file: Any) -> Any:
        request, error = super().create_request(scope, body_file)
        if request is not None and not request.META.get("CONTENT_LENGTH"):
            size = body_file.seek(0, os.SEEK_END)
            body_file.seek(0)
            if size:  # a chunked body: DRF reads none without a length
                request.META["CONTENT_LENGTH"] = str(size)
        return request, error

    async def _too_large(self, send: Any) -> None:
        from sageproject.api import too_large_body

        response = JsonResponse(
            too_large_body(), status=413, json_dumps_params={"separators": (",", ":")}
        )
        response["Connection"] = "close"
        await self.send_response(response, send)


class _BodyTooLarge(Exception):
    """A request body passed ``DATA_UPLOAD_MAX_MEMORY_SIZE`` while it was read."""


def _content_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope.get("headers", []):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def get_application() -> Any:
    """The web process's ASGI application (Django set up first)."""
    import django

    django.setup(set_prefix=False)
    from django.urls import get_resolver

    # The URL configuration (and every view module it imports) is loaded now, not by the
    # first requests while others wait for the import.
    _ = get_resolver().url_patterns
    handler = ThreadedASGIHandler()
    # What start-up made (modules, settings, URL patterns) lives as long as the process:
    # out of the collector's sight, a full collection no longer walks it. Such a walk is
    # a pause every request in flight would wait for (docs/PERFORMANCE.md).
    gc.freeze()
    return handler
