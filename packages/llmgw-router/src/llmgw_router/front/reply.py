"""One request on the router's own HTTP/1.1 server, and the answer written for it.

The request object collects what the parser hands over (protocol.py), and is the
:class:`~llmgw_router.proxy.Reply` the proxy answers through: the head goes out with
the first body bytes, in one write; a body of unknown length is sent chunked.
"""

from __future__ import annotations

import asyncio
import http
from typing import TYPE_CHECKING, Any, Protocol

from llmgw_router import request_id
from llmgw_router.errors import ApiError, error_body
from llmgw_router.state import now

if TYPE_CHECKING:
    from llmgw_router.config import ApiKey

__all__ = [
    "CLOSE",
    "CONTINUE",
    "Connection",
    "HttpRequest",
    "LateHead",
    "error_response",
    "internal_error",
]


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


_STATUS_LINES = {status: _status_line(status) for status in range(100, 600)}
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
CLOSE = b"connection: close\r\n"
_CHUNKED = b"transfer-encoding: chunked\r\n"
_LAST_CHUNK = b"0\r\n\r\n"


def error_response(status: int, message: str, code: str, extra: bytes = b"") -> bytes:
    """A whole HTTP/1.1 answer in OpenAI shape that ends the connection."""
    body = error_body(message, "invalid_request_error", None, code)
    return (
        _STATUS_LINES[status]
        + b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body)
        + b"x-request-id: %b\r\n" % request_id.new_id()
        + extra
        + CLOSE
        + b"\r\n"
        + body
    )


class Connection(Protocol):
    """What a request writes its answer to (protocol.py's ProxyProtocol)."""

    transport: asyncio.Transport | None
    lost: bool
    draining: bool
    write_paused: bool

    def response_done(self, request: HttpRequest) -> None: ...

    async def drain(self) -> None: ...


class LateHead(Protocol):
    """Head lines made as the head goes out (a limited key's x-ratelimit-* lines:
    tenants.limits.KeyState)."""

    def head_block(self, now: float) -> bytes:
        """The lines at ``now``, "name: value\\r\\n" each, written as they are."""
        ...


class HttpRequest:
    """One request as parsed, and the :class:`Reply` its answer is written through."""

    __slots__ = (
        "api_key",
        "chunked",
        "close_after",
        "conn",
        "content",
        "declared_length",
        "dropping",
        "gone",
        "head",
        "head_size",
        "headers",
        "keep_alive",
        "late_head",
        "method",
        "parts",
        "path",
        "received",
        "refusal",
        "remaining",
        "responded",
        "size",
        "started",
        "status",
        "task",
        "too_large",
        "url_parts",
    )

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.url_parts: list[bytes] = []
        # Bytes of request line and headers the parser handed over.
        self.head_size = 0
        self.method = ""
        self.path = ""
        self.headers: dict[bytes, bytes] = {}
        self.parts: list[bytes] = []
        self.size = 0
        self.content = b""
        self.too_large = False
        # Answered on its head (refused or too large): the body is dropped as it comes.
        self.dropping = False
        self.api_key: ApiKey | None = None
        self.refusal: ApiError | None = None
        self.declared_length: int | None = None
        self.keep_alive = True
        self.received = False
        self.started = False
        self.responded = False
        self.gone = False
        self.task: asyncio.Task[Any] | None = None
        self.status = 0
        self.head: list[tuple[bytes, bytes]] = []
        # Lines added after self.head's when the head goes out (ProxyApp.exchange sets
        # it for a limited key: the block is made and written whole, no name and value
        # each to encode and join); None for none.
        self.late_head: LateHead | None = None
        self.chunked = False
        self.close_after = False
        # Body bytes still owed under the response's own content-length (-1: none given).
        self.remaining = -1

    # -- Reply

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.head = headers

    async def body(self, data: bytes, more: bool = False) -> None:
        if self.responded:
            return
        conn = self.conn
        transport = conn.transport
        if conn.lost or transport is None:
            if not more:
                self.responded = True
            return
        bodiless = self.method == "HEAD" or self.status in (204, 304)
        if not self.started:
            self.started = True
            out = self._head_bytes(more, len(data), bodiless)
            if data and not bodiless:
                out += b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data
        elif bodiless:
            out = b""
        elif self.chunked:
            out = b"%x\r\n%b\r\n" % (len(data), data) if data else b""
        else:
            out = data
        if self.remaining >= 0 and not bodiless:
            self.remaining -= len(data)
        if not more and not bodiless:
            if self.chunked:
                out += _LAST_CHUNK
            elif self.remaining > 0:
                # Shorter than the content-length it announced: the client can only
                # tell from the connection's end.
                self.close_after = True
        if out:
            transport.write(out)
        if not more:
            self.responded = True
            conn.response_done(self)
        elif conn.write_paused:
            await conn.drain()

    def _head_bytes(self, more: bool, length: int, bodiless: bool) -> bytes:
        status = self.status
        line = _STATUS_LINES.get(status) or _status_line(status)
        out = [line]
        close = not self.keep_alive or self.conn.draining
        framed = said_close = False
        rid_name = request_id.HEADER
        rid = self.headers.get(rid_name) or request_id.new_id()
        out += (rid_name, b": ", rid, b"\r\n")
        for name, value in self.head:
            if name == rid_name:
                continue  # the request's own id, written above
            if name == b"content-length":
                framed = True
                if value.isdigit():
                    self.remaining = int(value)
            elif name == b"connection":
                if value.lower() != b"close":
                    continue
                close = said_close = True
            out += (name, b": ", value, b"\r\n")
        late = self.late_head
        if late is not None:
            out.append(late.head_block(now()))
        if not framed and not bodiless:
            if more:
                self.chunked = True
                out.append(_CHUNKED)
            else:
                out.append(b"content-length: %d\r\n" % length)
        if close and not said_close:
            out.append(CLOSE)
        self.close_after = close or self.close_after
        out.append(b"\r\n")
        return b"".join(out)


async def internal_error(request: HttpRequest) -> None:
    request.late_head = None  # a 500 of the router's own carries no key's lines
    body = error_body(
        "the router failed on this request; see its log", "server_error", None, "internal_error"
    )
    await request.start(
        500, [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    )
    request.close_after = True
    await request.body(body)
