"""The request path as a plain ASGI app (`server: hypercorn`, and tests over httpx).

The router's own HTTP server (protocol.py) reads the head and the whole body itself
and calls :meth:`ProxyApp.serve_request`; here the same stages run on ASGI messages:
the head from the scope, the body read (bounded) from ``receive``, and a task that
watches ``receive`` for the client's disconnect, which cancels the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from llmgw_router import request_id
from llmgw_router.config import ApiKey
from llmgw_router.errors import ApiError
from llmgw_router.proxy.admit import MODELS_PATH, Admission, too_large
from llmgw_router.proxy.context import Headers, Outcome, Reply, RequestContext, respond
from llmgw_router.proxy.routes import STORED_PREFIX, error_body
from llmgw_router.state import RouterState

__all__ = ["Receive", "Scope", "Send", "Stages", "serve_asgi"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class Stages(Protocol):
    """What the ASGI adapter runs (app.py's ProxyApp)."""

    state: RouterState
    admission: Admission

    async def context(
        self,
        path: str,
        headers: Headers,
        body: bytes,
        api_key: ApiKey | None,
        method: str = "POST",
    ) -> RequestContext: ...

    async def exchange(self, ctx: RequestContext, reply: Reply, outcome: Outcome) -> None: ...

    def count(self, outcome: Outcome) -> None: ...


class _AsgiReply:
    """A :class:`Reply` as ASGI messages; notes when the last one goes out."""

    __slots__ = ("_send", "finishing", "gone", "request_id", "task")

    def __init__(self, send: Send, task: asyncio.Task[Any] | None, rid: bytes) -> None:
        self._send = send
        self.finishing = False
        self.gone = False
        self.task = task
        # Every answer carries it (llmgw_router.request_id).
        self.request_id = rid

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        headers = request_id.with_id(headers, self.request_id)
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, data: bytes, more: bool = False) -> None:
        if not more:
            self.finishing = True
        await self._send({"type": "http.response.body", "body": data, "more_body": more})


class _ClientGone(Exception):
    pass


async def serve_asgi(app: Stages, scope: Scope, receive: Receive, send: Send) -> None:
    kind = scope["type"]
    if kind == "http":
        outcome = Outcome()
        given = {
            bytes(k).lower(): bytes(v)
            for k, v in scope["headers"]
            if bytes(k).lower() == request_id.HEADER
        }
        reply = _AsgiReply(send, asyncio.current_task(), request_id.ensure(given))
        try:
            await _route(app, scope, receive, reply, outcome)
        except ApiError as err:
            outcome.error_status, outcome.error_model = err.status, err.model
            await respond(reply, err.status, error_body(scope["path"], err), err.headers)
        finally:
            app.count(outcome)
    elif kind == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _route(
    app: Stages, scope: Scope, receive: Receive, reply: _AsgiReply, outcome: Outcome
) -> None:
    path = scope["path"]
    query = scope.get("query_string", b"")
    if query and path.startswith(STORED_PREFIX):
        # A stored response's query goes on to the engine as sent (routes.py).
        path = f"{path}?{bytes(query).decode('latin-1')}"
    headers: Headers = {}
    for key, value in scope["headers"]:
        headers.setdefault(bytes(key), bytes(value))
    headers[request_id.HEADER] = reply.request_id  # the engine gets the same id
    admission = app.admission
    api_key = admission.admit(scope["method"], path, headers)
    if path == MODELS_PATH:
        await respond(reply, 200, admission.models_body(api_key))
        return
    admission.check_draining()
    try:
        body = await _read_body(app.state.config.max_body_bytes, headers, receive)
    except _ClientGone:
        return
    ctx = await app.context(path, headers, body, api_key, scope["method"])
    watcher = asyncio.create_task(_watch_client(receive, reply))
    try:
        await app.exchange(ctx, reply, outcome)
    finally:
        watcher.cancel()


async def _read_body(limit: int, headers: Headers, receive: Receive) -> bytes:
    length = headers.get(b"content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large(limit, int(length))
    message = await receive()
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        if len(body) > limit:
            raise too_large(limit, None)
        return body
    parts = bytearray(body)
    while message.get("more_body", False):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        parts += message.get("body", b"")
        if len(parts) > limit:
            raise too_large(limit, None)
    return bytes(parts)


async def _watch_client(receive: Receive, reply: _AsgiReply) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            # Some servers (hypercorn) also say "disconnect" once the response is
            # complete; only one that comes before the last byte cancels anything.
            if not reply.finishing and reply.task is not None:
                reply.gone = True
                reply.task.cancel()
            return
