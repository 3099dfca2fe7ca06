"""The admin HTTP responder: /healthz, /metrics, /v1/status, /v1/summary, /v1/explain/{model}.

A few GET routes on loopback do not justify a web framework in the control
plane's wheel: this is a small HTTP/1.1 responder on ``asyncio.start_server``,
one request per connection. The JSON it serves is built in
:mod:`llmgw_control.status`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ssl
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec
import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from llmgw_control import webpage
from llmgw_control.auth import Credentials, Denied, authorize

__all__ = [
    "CHANGED_BY",
    "AdminServer",
    "Answer",
    "Handler",
    "StatusSource",
    "Streamer",
    "json_answer",
]

log = structlog.get_logger(__name__)

_REASONS = {
    200: "OK",
    201: "Created",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    413: "Content Too Large",
    503: "Service Unavailable",
}
_JSON = "application/json"
# The largest request body an extra handler is given (keys and operator verbs are small).
MAX_BODY = 64 * 1024

# Status, content type, body.
Answer = tuple[int, str, bytes]
# A route served by another module (keys, usage, ...): (method, target, body) -> an
# answer, or None when the path is not its own. It may await (a store write).
Handler = Callable[[str, str, bytes], Awaitable[Answer | None]]
# A GET route that writes its own streaming response (engine logs): (target, reader,
# writer) -> True when it was its own path and it answered (the reader tells a client gone).
Streamer = Callable[[str, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]
# Who made the change a handler is serving (llmgw_control.auth: "token", "admin:NAME").
CHANGED_BY: contextvars.ContextVar[str] = contextvars.ContextVar("changed_by", default="")


class StatusSource(Protocol):
    def status(self) -> dict[str, Any]: ...
    def summary(self) -> dict[str, Any]: ...
    def explain(self, model: str) -> dict[str, Any] | None: ...


class AdminServer:
    def __init__(
        self, source: StatusSource, registry: CollectorRegistry, *, insecure: bool = False
    ) -> None:
        self.source = source
        self.registry = registry
        # Shown on /healthz so nobody runs plaintext streams without noticing.
        self.insecure = insecure
        # Asked in order before the built-in GET routes (see Handler).
        self.handlers: list[Handler] = []
        self.streamers: list[Streamer] = []
        # Every request but GET and HEAD needs these (llmgw_control.auth); None: no check.
        self.credentials: Credentials | None = None
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int, *, tls: ssl.SSLContext | None = None) -> None:
        self._server = await asyncio.start_server(self._handle, host, port, ssl=tls)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    def route(self, method: str, target: str) -> tuple[int, str, bytes]:
        """Status, content type and body for one request; pure of sockets."""
        if method not in ("GET", "HEAD"):
            return _error(405, f"{method} is not supported: use GET")
        path = urllib.parse.urlsplit(target).path
        if path in webpage.PATHS:  # the web status page, over /v1/status
            return webpage.page()
        if path == "/healthz":
            body = (
                b"ok (insecure: plaintext streams, peers not authenticated)\n"
                if self.insecure
                else b"ok\n"
            )
            return 200, "text/plain; charset=utf-8", body
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)
        if path == "/v1/status":
            return 200, _JSON, msgspec.json.encode(self.source.status())
        if path == "/v1/summary":
            return 200, _JSON, msgspec.json.encode(self.source.summary())
        if path.startswith("/v1/explain/"):
            model = urllib.parse.unquote(path.removeprefix("/v1/explain/"))
            found = self.source.explain(model)
            if found is None:
                return _error(404, f"model {model!r} is not in the catalog and has no replicas")
            return 200, _JSON, msgspec.json.encode(found)
        return _error(404, f"no such path {path!r}: try /, /v1/status, /v1/explain/MODEL, /metrics")

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10.0)
            request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
            parts = request_line.split(" ")
            if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
                status, ctype, body = _error(400, "malformed request line")
                method = "GET"
            else:
                method = parts[0]
                if method == "GET" and await self._stream(parts[1], reader, writer):
                    return
                denied = self._denied(method, parts[1], head, writer)
                if denied is not None:
                    status, ctype, body = denied
                else:
                    status, ctype, body = await self._answer(method, parts[1], reader, head)
            headers = (
                f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
                f"Content-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n"
            )
            writer.write(headers.encode("latin-1") + (b"" if method == "HEAD" else body))
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass
        except Exception:
            log.exception("admin request failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _stream(
        self, target: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        for streamer in self.streamers:
            if await streamer(target, reader, writer):
                return True
        return False

    def _denied(
        self, method: str, target: str, head: bytes, writer: asyncio.StreamWriter
    ) -> Answer | None:
        """A change without the admin credential is refused; who made it, for the handlers."""
        if method in ("GET", "HEAD") or self.credentials is None:
            return None
        who = authorize(
            self.credentials, _header(head, b"authorization"), writer.get_extra_info("peercert")
        )
        if isinstance(who, Denied):
            peer = writer.get_extra_info("peername")
            log.warning(
                "admin change refused",
                method=method[:10],
                path=urllib.parse.urlsplit(target).path[:200],
                peer=str(peer[0]) if peer else "",
                why=who.reason,
            )
            return _error(who.status, who.reason)
        CHANGED_BY.set(who)
        return None

    async def _answer(
        self, method: str, target: str, reader: asyncio.StreamReader, head: bytes
    ) -> Answer:
        """The extra handlers' answer (with the request's body), else the GET routes'."""
        if self.handlers:
            length = _content_length(head)
            if length is None:
                return _error(400, "malformed Content-Length header")
            if length > MAX_BODY:
                return _error(413, f"request body over {MAX_BODY} bytes")
            body = await asyncio.wait_for(reader.readexactly(length), 10.0) if length else b""
            for handler in self.handlers:
                found = await handler(method, target, body)
                if found is not None:
                    return found
        return self.route(method, target)


def _content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            text = value.strip()
            return int(text) if text.isdigit() else None
    return 0


def _header(head: bytes, name: bytes) -> str:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip().decode("latin-1")
    return ""


def json_answer(status: int, data: Any) -> Answer:
    return status, _JSON, msgspec.json.encode(data)


def _error(status: int, message: str) -> Answer:
    return status, _JSON, msgspec.json.encode({"error": message})
