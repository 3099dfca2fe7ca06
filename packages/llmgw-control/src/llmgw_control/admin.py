"""The admin HTTP responder: /healthz, /metrics, /v1/status, /v1/summary, /v1/explain/{model}.

A few GET routes on loopback do not justify a web framework in the control
plane's wheel: this is a small HTTP/1.1 responder on ``asyncio.start_server``,
one request per connection. The JSON it serves is built in
:mod:`llmgw_control.status`.

What a client may send is bounded (fixed; the README's "admin API bounds"): the head
(request line and headers) to ``MAX_HEAD`` bytes (past it 414 while still in the
request line, else 431) and ``MAX_HEADERS`` header lines (431); the head must arrive
within ``HEAD_TIMEOUT`` seconds of the accept and a body within ``BODY_TIMEOUT`` of
its head (408); a body over ``MAX_BODY`` gets 413; beyond ``MAX_CONNECTIONS``
connections at once (engine-log streams included) a connection is answered 503 with
Retry-After. After an error answer the connection is closed as nginx does: our side
is shut for writing and what the client still sends is dropped (up to
``LINGER_BYTES`` or ``LINGER_SECONDS``), so that it reads the answer, not a reset.
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
    "head_problem",
    "json_answer",
    "overlong_head",
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
    408: "Request Timeout",
    409: "Conflict",
    413: "Content Too Large",
    414: "URI Too Long",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}
_JSON = "application/json"
# The largest request body an extra handler is given (keys and operator verbs are small).
MAX_BODY = 64 * 1024
# What one connection may send before it is judged, and how many may be open at once.
MAX_HEAD = 16 * 1024
MAX_HEADERS = 64
HEAD_TIMEOUT = 10.0
BODY_TIMEOUT = 10.0
MAX_CONNECTIONS = 128
# After an error answer: what the client still sends is dropped up to this, then closed.
LINGER_BYTES = 256 * 1024
LINGER_SECONDS = 2.0

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
        # Connections being served now (bounded by MAX_CONNECTIONS).
        self._open = 0

    async def start(self, host: str, port: int, *, tls: ssl.SSLContext | None = None) -> None:
        self._server = await asyncio.start_server(self._handle, host, port, ssl=tls, limit=MAX_HEAD)

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
        self._open += 1
        try:
            if self._open > MAX_CONNECTIONS:
                status, ctype, body = _error(
                    503,
                    f"the admin API holds its limit of {MAX_CONNECTIONS} connections at once;"
                    " retry shortly",
                )
                method = "GET"
            else:
                status, ctype, body, method = await self._serve(reader, writer)
                if status == 0:
                    return  # a stream answered, or the client went away
            headers = (
                f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
                f"Content-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\n"
                + ("Retry-After: 1\r\n" if status == 503 else "")
                + "Connection: close\r\n\r\n"
            )
            writer.write(headers.encode("latin-1") + (b"" if method == "HEAD" else body))
            await writer.drain()
            if status >= 400:
                await _linger(reader, writer)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass
        except Exception:
            log.exception("admin request failed")
        finally:
            self._open -= 1
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[int, str, bytes, str]:
        """Status (0: answered already or nobody to answer), content type, body, method."""
        head_or_error = await _read_head(reader)
        if head_or_error is None:
            return 0, "", b"", "GET"
        if isinstance(head_or_error, tuple):
            return (*head_or_error, "GET")
        head = head_or_error
        problem = head_problem(head)
        if problem is not None:
            return (*problem, "GET")
        parts = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
        method, target = parts[0], parts[1]
        if method == "GET" and await self._stream(target, reader, writer):
            return 0, "", b"", method
        denied = self._denied(method, target, head, writer)
        if denied is not None:
            return (*denied, method)
        return (*await self._answer(method, target, reader, head), method)

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
            try:
                body = (
                    await asyncio.wait_for(reader.readexactly(length), BODY_TIMEOUT)
                    if length
                    else b""
                )
            except TimeoutError:
                return _error(
                    408, f"the request body did not arrive within {BODY_TIMEOUT:g} s of its head"
                )
            for handler in self.handlers:
                found = await handler(method, target, body)
                if found is not None:
                    return found
        return self.route(method, target)


def head_problem(head: bytes) -> Answer | None:
    """What is wrong with a whole request head (ending in a blank line), or None."""
    parts = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return _error(400, "malformed request line")
    lines = head.count(b"\r\n") - 2  # the request line's and the blank line's ends
    if lines > MAX_HEADERS:
        return _error(431, f"{lines} header lines: the admin API takes at most {MAX_HEADERS}")
    return None


def overlong_head(seen: bytes) -> Answer:
    """The answer to a head past MAX_HEAD of which ``seen`` arrived: 414 while the
    request line is not complete, else 431."""
    if b"\n" not in seen:
        return _error(414, f"the request line (URL) is over the limit of {MAX_HEAD} bytes")
    return _error(431, f"the request head is over the limit of {MAX_HEAD} bytes")


async def _read_head(reader: asyncio.StreamReader) -> bytes | Answer | None:
    """The request head, an error answer for one too large or too slow, or None when the
    client closed before a whole head (nobody to answer)."""
    try:
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT)
    except asyncio.IncompleteReadError as err:
        if not err.partial:
            return None
        return _error(400, "the connection ended inside the request head")
    except TimeoutError:
        return _error(
            408, f"the request head did not arrive within {HEAD_TIMEOUT:g} s of the connection"
        )
    except asyncio.LimitOverrunError:
        return overlong_head(await reader.read(MAX_HEAD))


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """After an error answer: shut our side and drop what the client still sends, so it
    reads the answer instead of a reset (bounded: LINGER_BYTES, LINGER_SECONDS)."""
    if writer.can_write_eof():
        writer.write_eof()
    left = LINGER_BYTES

    async def drop() -> None:
        nonlocal left
        while left > 0:
            data = await reader.read(min(left, 65536))
            if not data:
                return
            left -= len(data)

    with contextlib.suppress(TimeoutError, OSError):
        await asyncio.wait_for(drop(), LINGER_SECONDS)


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
