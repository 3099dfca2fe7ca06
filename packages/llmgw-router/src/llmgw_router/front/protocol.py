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

What a client may send before it is judged is bounded (``http:`` in the config):

- the head (request line and headers) is fed to the parser only up to
  ``max_head_bytes``; past it the request is answered 414 (the request line is not
  complete) or 431, and the connection closes. The parser never holds more;
- the route and the API key are checked on the head (:meth:`ProxyApp.admit`), before
  any body byte is read and before ``100 Continue``: a wrong key gets its 401 and the
  connection closes; a 404, 405 or 413 drops the body as it comes and keeps the
  connection;
- a head not complete ``head_timeout`` after its first byte (or after the accept),
  and a body not complete ``body_timeout`` after its head, get 408 and the
  connection closes (the same sweep as keep-alive checks the deadlines);
- beyond ``max_connections`` connections, a request is answered 503 (Retry-After)
  and its connection closes.

Each answer written here (400, 408, 414, 431) is counted in
``llmgw_router_requests_total`` with ``model=""`` and ``endpoint=""``.

A connection closed after an answer while the client may still be sending is closed
as nginx does ("lingering close"): our side is shut for writing, and what still comes
is read and dropped, up to ``LINGER_BYTES`` or ``LINGER_SECONDS``, so that the client
reads the answer instead of a reset.

uvicorn's server still binds the sockets and runs the graceful shutdown: it
calls :meth:`ProxyProtocol.shutdown` on every connection (idle ones close, busy
ones close after their response) and waits for its connection set to empty.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import httptools
import structlog

from llmgw_router import request_id
from llmgw_router.errors import ApiError
from llmgw_router.front.framing import framing_error_response
from llmgw_router.front.reply import CONTINUE, HttpRequest, error_response, internal_error

if TYPE_CHECKING:
    from llmgw_router.proxy import ProxyApp

__all__ = ["ProxyProtocol", "head_room", "protocol_factory", "sweep_idle", "sweep_interval"]

log = structlog.get_logger(__name__)

# After an answer that closes the connection, what the client still sends is dropped
# up to this many bytes, for at most this many seconds (see the module docstring).
LINGER_BYTES = 256 * 1024
LINGER_SECONDS = 2.0

# What a connection's deadline is for.
_NO_DEADLINE, _HEAD, _BODY, _LINGER = 0, 1, 2, 3


def head_room(seen: int, limit: int, size: int) -> int:
    """How many of ``size`` new bytes may go to the parser while a head is incomplete.

    ``seen`` bytes of the head were fed already; at most ``limit`` ever are.
    """
    return max(0, min(size, limit - seen))


def sweep_interval(keep_alive: float, head_timeout: float, body_timeout: float) -> float:
    """How often the sweep looks at deadlines: a quarter of the shortest, 50 ms to 5 s."""
    return max(0.05, min(5.0, keep_alive / 4, head_timeout / 4, body_timeout / 4))


# The stored responses' routes (proxy/routes.py), whose query string the engine gets.
_STORED = b"/v1/responses/"


class _HeadTooLarge(Exception):
    """Raised from a parser callback: the head went past ``max_head_bytes``."""


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
        config = app.state.config
        self.limit = config.max_body_bytes
        self.max_head = config.http.max_head_bytes
        self.head_timeout = config.http.head_timeout
        self.body_timeout = config.http.body_timeout
        self.max_connections = config.http.max_connections
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
        self.parsing: HttpRequest | None = None
        self.active: HttpRequest | None = None
        self.queue: collections.deque[HttpRequest] = collections.deque()
        self.idle_since = loop.time()
        # Between requests or inside a head: bytes of it fed to the parser so far, and
        # whether its request line ended among them.
        self.in_head = True
        self.head_seen = 0
        self.line_done = False
        # When the head, the body or the lingering close in progress must be done by.
        self.deadline = 0.0
        self.deadline_kind = _NO_DEADLINE
        self.lingering = False
        self.linger_left = 0
        # Accepted beyond max_connections: its request is answered 503.
        self.over_limit = False

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.over_limit = len(self.connections) >= self.max_connections
        self.connections.add(self)
        # A connection that never completes a head is closed like a slow head.
        self._set_deadline(_HEAD)

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
        if self.lingering:
            # The answer is out and the connection closing: drop what still comes.
            self.linger_left -= len(data)
            if self.linger_left < 0 and self.transport is not None:
                self.transport.close()
            return
        while self.in_head and data:
            # The head goes to the parser only up to max_head_bytes: a huge header or
            # URL is judged on its first bytes, never read (nor accumulated) whole.
            if self.deadline_kind != _HEAD:
                self._set_deadline(_HEAD)
            room = head_room(self.head_seen, self.max_head, len(data))
            part = data[:room] if room < len(data) else data
            data = data[len(part) :]
            self.head_seen += len(part)
            if not self.line_done and b"\n" in part:
                self.line_done = True
            if part and not self._feed(part):
                return
            if self.in_head and data:
                self._head_too_large()
                return
        if data:
            self._feed(data)

    def _feed(self, data: bytes) -> bool:
        """Parse ``data``; False when the connection was refused for it."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # No upgrades here: a request that came whole is answered as HTTP/1.1.
            parsing = self.parsing
            if parsing is not None and not parsing.received:
                self._refuse("Upgrade is not supported")
            return False
        except httptools.HttpParserCallbackError as err:
            if isinstance(err.__context__, _HeadTooLarge):
                self._head_too_large()
            else:
                self._refuse(str(err))
            return False
        except httptools.HttpParserError as err:
            self._refuse(str(err))
            return False
        return not self.lingering and not (self.transport is None or self.transport.is_closing())

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_writer()

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        self.parsing = HttpRequest(self)

    def on_url(self, url: bytes) -> None:
        request = self.parsing
        assert request is not None
        request.url_parts.append(url)
        request.head_size += len(url)
        if request.head_size > self.max_head:
            # A pipelined head that came in one read with the body before it.
            raise _HeadTooLarge

    def on_header(self, name: bytes, value: bytes) -> None:
        request = self.parsing
        assert request is not None
        self.line_done = True
        request.head_size += len(name) + len(value) + 4
        if request.head_size > self.max_head:
            raise _HeadTooLarge
        request.headers.setdefault(name.lower(), value)

    def on_headers_complete(self) -> None:
        request = self.parsing
        assert request is not None
        parser = self.parser
        request.method = parser.get_method().decode("ascii")
        request.keep_alive = parser.should_keep_alive()
        self.in_head = False
        self.head_seen = 0
        self._set_deadline(_BODY)
        parts = request.url_parts
        url = parts[0] if len(parts) == 1 else b"".join(parts)
        tail = b""
        if url[:1] != b"/":
            # Absolute form (`POST http://host/v1/...`) or `*`.
            url = httptools.parse_url(url).path or b"/"
        else:
            query = url.find(b"?")
            if query >= 0:
                # A stored response's query (``include``, ``starting_after``, ``limit``,
                # ``order``, ...) goes on to the engine as the client sent it (routes.py);
                # every other route takes none.
                tail = url[query:] if url.startswith(_STORED) else b""
                url = url[:query]
        path = url.decode("latin-1")
        if "%" in path:
            path = unquote(path)
        request.path = path + tail.decode("latin-1") if tail else path
        headers = request.headers
        request_id.ensure(headers)  # the engine gets it, the answer carries it
        # Judged on the head: route and key (a wrong key reads no body and gets no
        # `100 Continue`), then the connection bound, then the declared length.
        try:
            request.api_key = self.app.admit(request.method, request.path, headers)
        except ApiError as err:
            request.refusal = err
            if err.status == 401:
                request.keep_alive = False
        if request.refusal is None and self.over_limit:
            request.refusal = ApiError(
                503,
                f"this router worker holds its limit of {self.max_connections} connections"
                " (http.max_connections); retry shortly",
                "server_error",
                code="too_many_connections",
                headers=[(b"retry-after", b"1")],
            )
            request.keep_alive = False
        length = headers.get(b"content-length")
        if length is not None and length.isdigit():
            request.declared_length = int(length)
            if request.declared_length > self.limit:
                request.too_large = True
        request.dropping = request.too_large or request.refusal is not None
        expect = headers.get(b"expect")
        if (
            expect is not None
            and expect.lower() == b"100-continue"
            and not request.dropping
            and self.active is None
            and self.transport is not None
        ):
            self.transport.write(CONTINUE)
        if request.dropping:
            # Answered now; what follows of the body is dropped (or, when the answer
            # closes the connection, dropped up to a bound while it closes).
            self._enqueue(request)

    def on_body(self, body: bytes) -> None:
        request = self.parsing
        assert request is not None
        if request.dropping:
            return
        request.size += len(body)
        if request.size > self.limit:
            request.too_large = request.dropping = True
            request.parts = []
            self._enqueue(request)
            return
        request.parts.append(body)

    def on_message_complete(self) -> None:
        request = self.parsing
        assert request is not None
        self.parsing = None
        request.received = True
        self.in_head = True
        self.line_done = False
        self.deadline_kind = _NO_DEADLINE
        if request.dropping:
            # Already queued or answered (on_headers_complete / on_body).
            if request.responded and self.active is request:
                self._next()
            return
        parts = request.parts
        request.content = parts[0] if len(parts) == 1 else b"".join(parts)
        request.parts = []
        self._enqueue(request)

    # -- serving

    def _enqueue(self, request: HttpRequest) -> None:
        if self.active is None and not self.queue:
            self._start(request)
        else:
            # Pipelined: wait for the answers before it; stop reading meanwhile.
            self.queue.append(request)
            if not self.reading_paused and self.transport is not None:
                self.reading_paused = True
                self.transport.pause_reading()

    def _start(self, request: HttpRequest) -> None:
        self.active = request
        task = self.loop.create_task(self._serve(request))
        request.task = task
        self.tasks.add(task)

    async def _serve(self, request: HttpRequest) -> None:
        try:
            await self.app.serve_request(request)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("request failed", path=request.path)
            if not request.started:
                await internal_error(request)
        finally:
            task = request.task
            if task is not None:
                self.tasks.discard(task)
            if not request.responded:
                # Cancelled or failed half-way: the client cannot make sense of the rest.
                request.responded = True
                if self.transport is not None:
                    self.transport.close()

    def response_done(self, request: HttpRequest) -> None:
        """The last byte of ``request``'s answer is written."""
        if request.close_after or self.transport is None:
            if self.transport is not None:
                if request.received and self.parsing is None:
                    self.transport.close()
                else:
                    # The client may still be sending its body: let it read the answer.
                    self._linger()
            return
        self.idle_since = self.loop.time()
        if request.received:
            self._next()

    def _next(self) -> None:
        self.active = None
        if self.draining and self.transport is not None:
            self.transport.close()
            return
        if self.deadline_kind in (_HEAD, _BODY):
            # Its time did not run while the request before it was answered.
            self._set_deadline(self.deadline_kind)
        if self.queue:
            self._start(self.queue.popleft())
        if not self.queue and self.reading_paused and self.transport is not None:
            self.reading_paused = False
            self.transport.resume_reading()

    def _set_deadline(self, kind: int) -> None:
        self.deadline_kind = kind
        timeout = self.head_timeout if kind == _HEAD else self.body_timeout
        self.deadline = self.loop.time() + (LINGER_SECONDS if kind == _LINGER else timeout)

    def _head_too_large(self) -> None:
        """A head past max_head_bytes: 414 while still in the request line, else 431."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self.active is not None:
            # An answer is being written on this connection: no room for another.
            transport.close()
            return
        if self.line_done:
            status, what, code = 431, "request headers are", "request_header_fields_too_large"
        else:
            status, what, code = 414, "request line (URL) is", "uri_too_long"
        transport.write(
            error_response(
                status,
                f"the {what} over the limit of {self.max_head} bytes of request head"
                " (http.max_head_bytes)",
                code,
            )
        )
        self._count_refusal(status)
        self._linger()

    def _linger(self) -> None:
        """Close after an answer while the client may still send: see the docstring."""
        transport = self.transport
        if transport is None or transport.is_closing() or self.lingering:
            return
        self.lingering = True
        self.linger_left = LINGER_BYTES
        self._set_deadline(_LINGER)
        if transport.can_write_eof():
            transport.write_eof()
        if self.reading_paused:
            self.reading_paused = False
            transport.resume_reading()

    def check_deadline(self, now: float) -> None:
        """Close a connection whose head, body or lingering close ran out of time."""
        kind = self.deadline_kind
        transport = self.transport
        if kind == _NO_DEADLINE or now < self.deadline or transport is None:
            return
        if transport.is_closing():
            return
        if kind == _LINGER:
            transport.close()
            return
        active = self.active
        if self.reading_paused or (active is not None and active is not self.parsing):
            # Not reading, or the client waits for an answer: not its delay.
            return
        if kind == _HEAD and self.parsing is None:
            # Connected (or answered) and no request begun since: closed without an answer.
            transport.close()
            return
        if active is None:
            what, setting = ("head", "head_timeout") if kind == _HEAD else ("body", "body_timeout")
            limit = self.head_timeout if kind == _HEAD else self.body_timeout
            transport.write(
                error_response(
                    408,
                    f"the request {what} did not arrive within {limit:g} s (http.{setting})",
                    "request_timeout",
                )
            )
            self._count_refusal(408)
        transport.close()

    def _refuse(self, detail: str) -> None:
        """A request the parser could not read: a 400 in OpenAI shape, then close."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self.active is None:
            transport.write(framing_error_response(detail))
            self._count_refusal(400)
        transport.close()

    def _count_refusal(self, status: int) -> None:
        """An answer written here, before any route or model is known, is counted too:
        ``model=""`` and ``endpoint=""``, as the proxy counts its early refusals."""
        metrics = self.app.state.metrics
        metrics.child(metrics.requests, "", str(status), "").inc()

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
    """Close keep-alive connections idle for longer than ``keep_alive`` seconds, and
    those whose head, body or lingering close is past its deadline."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(every)
        at = loop.time()
        for conn in list(connections):
            if isinstance(conn, ProxyProtocol):
                conn.check_deadline(at)
                conn.close_if_idle(at, keep_alive)
