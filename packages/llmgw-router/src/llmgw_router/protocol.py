"""The router's own HTTP/1.1 server protocol for the OpenAI routes.

uvicorn's ASGI cycle cost more CPU per request than everything the proxy itself
does: a scope dict, message dicts, receive and send coroutines, an event per
request, header checks by regular expression, a keep-alive timer armed and
cancelled per response, and the proxy's own task watching ``receive`` for a
disconnect. This protocol does only what the proxy needs:

- httptools parses the request (the C parser uvicorn uses too); headers go into
  one dict (lower-case names, the first of repeated ones), the body is collected
  whole, bounded by ``max_body_bytes`` (past it the rest is read and dropped and
  the request answered 413);
- the whole request goes to :meth:`ProxyApp.serve_request` in one task; the
  request object is also the :class:`~llmgw_router.proxy.Reply` the answer is
  written through: the head goes out with the first body bytes, in one write;
  a body of unknown length is sent chunked;
- a lost connection marks the request ``gone`` and cancels its task, which
  closes the upstream connection (the engine stops);
- framing errors are answered in OpenAI shape (framing.py) and close the
  connection; pipelined requests wait their turn; ``Expect: 100-continue`` is
  honoured; a keep-alive connection idle for ``keep_alive`` seconds is closed by
  one sweep for all connections, not a timer per response.

uvicorn's server still binds the sockets and runs the graceful shutdown: it
calls :meth:`ProxyProtocol.shutdown` on every connection (idle ones close, busy
ones close after their response) and waits for its connection set to empty.
"""

from __future__ import annotations

import asyncio
import collections
import http
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import httptools
import structlog

from llmgw_router.errors import error_body
from llmgw_router.framing import framing_error_response

if TYPE_CHECKING:
    from llmgw_router.proxy import ProxyApp

__all__ = ["ProxyProtocol", "protocol_factory", "sweep_idle"]

log = structlog.get_logger(__name__)


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


_STATUS_LINES = {status: _status_line(status) for status in range(100, 600)}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_CLOSE = b"connection: close\r\n"
_CHUNKED = b"transfer-encoding: chunked\r\n"
_LAST_CHUNK = b"0\r\n\r\n"


class _Request:
    """One request as parsed, and the :class:`Reply` its answer is written through."""

    __slots__ = (
        "chunked",
        "close_after",
        "conn",
        "content",
        "declared_length",
        "gone",
        "head",
        "headers",
        "keep_alive",
        "method",
        "parts",
        "path",
        "received",
        "remaining",
        "responded",
        "size",
        "started",
        "status",
        "task",
        "too_large",
        "url",
    )

    def __init__(self, conn: ProxyProtocol) -> None:
        self.conn = conn
        self.url = b""
        self.method = ""
        self.path = ""
        self.headers: dict[bytes, bytes] = {}
        self.parts: list[bytes] = []
        self.size = 0
        self.content = b""
        self.too_large = False
        self.declared_length: int | None = None
        self.keep_alive = True
        self.received = False
        self.started = False
        self.responded = False
        self.gone = False
        self.task: asyncio.Task[Any] | None = None
        self.status = 0
        self.head: list[tuple[bytes, bytes]] = []
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
        for name, value in self.head:
            if name == b"content-length":
                framed = True
                if value.isdigit():
                    self.remaining = int(value)
            elif name == b"connection":
                if value.lower() != b"close":
                    continue
                close = said_close = True
            out += (name, b": ", value, b"\r\n")
        if not framed and not bodiless:
            if more:
                self.chunked = True
                out.append(_CHUNKED)
            else:
                out.append(b"content-length: %d\r\n" % length)
        if close and not said_close:
            out.append(_CLOSE)
        self.close_after = close or self.close_after
        out.append(b"\r\n")
        return b"".join(out)


class ProxyProtocol(asyncio.Protocol):
    """One client connection: requests in order, each served by the proxy in a task."""

    def __init__(
        self,
        app: ProxyApp,
        loop: asyncio.AbstractEventLoop,
        connections: set[Any],
        tasks: set[asyncio.Task[Any]],
    ) -> None:
        self.app = app
        self.loop = loop
        self.connections = connections
        self.tasks = tasks
        self.limit = app.state.config.max_body_bytes
        self.parser = httptools.HttpRequestParser(self)
        # Answer a request even when the client sent more after a `connection: close`.
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.draining = False
        self.write_paused = False
        self._drain: asyncio.Future[None] | None = None
        self.reading_paused = False
        # The request being parsed, the one being answered, and complete ones waiting.
        self.parsing: _Request | None = None
        self.active: _Request | None = None
        self.queue: collections.deque[_Request] = collections.deque()
        self.idle_since = loop.time()

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.connections.discard(self)
        self.queue.clear()
        active = self.active
        if active is not None and not active.responded:
            active.gone = True
            if active.task is not None:
                active.task.cancel()
        self._wake_writer()

    def eof_received(self) -> bool | None:
        # The client closed its side: treated as gone (the transport closes).
        return None

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # No upgrades here: a request that came whole is answered as HTTP/1.1.
            parsing = self.parsing
            if parsing is not None and not parsing.received:
                self._refuse("Upgrade is not supported")
        except httptools.HttpParserError as err:
            self._refuse(str(err))

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_writer()

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        self.parsing = _Request(self)

    def on_url(self, url: bytes) -> None:
        assert self.parsing is not None
        self.parsing.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.parsing is not None
        self.parsing.headers.setdefault(name.lower(), value)

    def on_headers_complete(self) -> None:
        request = self.parsing
        assert request is not None
        parser = self.parser
        request.method = parser.get_method().decode("ascii")
        request.keep_alive = parser.should_keep_alive()
        url = request.url
        if url[:1] != b"/":
            # Absolute form (`POST http://host/v1/...`) or `*`.
            url = httptools.parse_url(url).path or b"/"
        else:
            query = url.find(b"?")
            if query >= 0:
                url = url[:query]
        path = url.decode("latin-1")
        request.path = unquote(path) if "%" in path else path
        headers = request.headers
        length = headers.get(b"content-length")
        if length is not None and length.isdigit():
            request.declared_length = int(length)
            if request.declared_length > self.limit:
                request.too_large = True
        expect = headers.get(b"expect")
        if (
            expect is not None
            and expect.lower() == b"100-continue"
            and not request.too_large
            and self.active is None
            and self.transport is not None
        ):
            self.transport.write(_CONTINUE)
        if request.too_large:
            # Answered now; what follows of the body is read and dropped.
            self._enqueue(request)

    def on_body(self, body: bytes) -> None:
        request = self.parsing
        assert request is not None
        if request.too_large:
            return
        request.size += len(body)
        if request.size > self.limit:
            request.too_large = True
            request.parts = []
            self._enqueue(request)
            return
        request.parts.append(body)

    def on_message_complete(self) -> None:
        request = self.parsing
        assert request is not None
        self.parsing = None
        request.received = True
        if request.too_large:
            # Already queued or answered (on_headers_complete / on_body).
            if request.responded and self.active is request:
                self._next()
            return
        parts = request.parts
        request.content = parts[0] if len(parts) == 1 else b"".join(parts)
        request.parts = []
        self._enqueue(request)

    # -- serving

    def _enqueue(self, request: _Request) -> None:
        if self.active is None and not self.queue:
            self._start(request)
        else:
            # Pipelined: wait for the answers before it; stop reading meanwhile.
            self.queue.append(request)
            if not self.reading_paused and self.transport is not None:
                self.reading_paused = True
                self.transport.pause_reading()

    def _start(self, request: _Request) -> None:
        self.active = request
        task = self.loop.create_task(self._serve(request))
        request.task = task
        self.tasks.add(task)

    async def _serve(self, request: _Request) -> None:
        try:
            await self.app.serve_request(request)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("request failed", path=request.path)
            if not request.started:
                await _internal_error(request)
        finally:
            task = request.task
            if task is not None:
                self.tasks.discard(task)
            if not request.responded:
                # Cancelled or failed half-way: the client cannot make sense of the rest.
                request.responded = True
                if self.transport is not None:
                    self.transport.close()

    def response_done(self, request: _Request) -> None:
        """The last byte of ``request``'s answer is written."""
        if request.close_after or self.transport is None:
            if self.transport is not None:
                self.transport.close()
            return
        self.idle_since = self.loop.time()
        if request.received:
            self._next()

    def _next(self) -> None:
        self.active = None
        if self.draining and self.transport is not None:
            self.transport.close()
            return
        if self.queue:
            self._start(self.queue.popleft())
        if not self.queue and self.reading_paused and self.transport is not None:
            self.reading_paused = False
            self.transport.resume_reading()

    def _refuse(self, detail: str) -> None:
        """A request the parser could not read: a 400 in OpenAI shape, then close."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self.active is None:
            transport.write(framing_error_response(detail))
        transport.close()

    async def drain(self) -> None:
        """Wait until the transport's write buffer is below its low-water mark."""
        if not self.write_paused or self.lost:
            return
        waiter = self._drain
        if waiter is None:
            waiter = self._drain = self.loop.create_future()
        await waiter

    def _wake_writer(self) -> None:
        waiter = self._drain
        if waiter is not None:
            self._drain = None
            if not waiter.done():
                waiter.set_result(None)

    # -- for uvicorn's server

    def shutdown(self) -> None:
        """Graceful shutdown: close when idle, else right after the answer in progress."""
        self.draining = True
        if self.active is None and self.transport is not None:
            self.transport.close()

    def close_if_idle(self, now: float, keep_alive: float) -> None:
        if (
            self.active is None
            and self.parsing is None
            and self.transport is not None
            and now - self.idle_since > keep_alive
        ):
            self.transport.close()


async def _internal_error(request: _Request) -> None:
    body = error_body(
        "the router failed on this request; see its log", "server_error", None, "internal_error"
    )
    await request.start(
        500, [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    )
    request.close_after = True
    await request.body(body)


def protocol_factory(app: ProxyApp) -> Callable[..., ProxyProtocol]:
    """What uvicorn's ``Config(http=...)`` takes: built per connection with its state."""
    loop = asyncio.get_running_loop()

    def create(
        config: Any = None,
        server_state: Any = None,
        app_state: Any = None,
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> ProxyProtocol:
        return ProxyProtocol(app, loop, server_state.connections, server_state.tasks)

    return create


async def sweep_idle(connections: set[Any], keep_alive: float, every: float = 5.0) -> None:
    """Close keep-alive connections idle for longer than ``keep_alive`` seconds."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(every)
        at = loop.time()
        for conn in list(connections):
            if isinstance(conn, ProxyProtocol):
                conn.close_if_idle(at, keep_alive)
