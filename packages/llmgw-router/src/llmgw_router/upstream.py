"""The router's HTTP/1.1 client to the engines: pooled keep-alive connections.

Why not aiohttp's client (still used for health checks): on the request path it
cost about as much CPU as everything else the router does per request. This
client does one thing: send a POST with a body that is already bytes, and hand
back the status, the headers and the body chunks as they arrive (httptools
undoes the chunked framing). A connection goes back to its endpoint's pool only
after a response that ended cleanly; closing one is how an engine learns that
its client went away.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time

import httptools
from llmgw_proto.addr import parse_endpoint_url

__all__ = ["ConnectError", "Pool", "ResetError", "Response", "UpstreamError"]


class UpstreamError(Exception):
    """The engine could not be reached or broke off the exchange."""


class ConnectError(UpstreamError):
    pass


class ResetError(UpstreamError):
    pass


_FRAMED = frozenset({b"content-length", b"transfer-encoding"})
# A response body buffered past this pauses reading from the engine.
_PAUSE_AT = 1 << 20


class _Connection(asyncio.Protocol):
    def __init__(self, pool: _HostPool, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        # Kept: on Python 3.11 every asyncio.get_running_loop() is a getpid() system
        # call, and a stream would make one per chunk.
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.response: Response | None = None
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        response = self.response
        if response is not None:
            names = {name for name, _ in response.headers}
            if response.status and exc is None and not names & _FRAMED:
                # A body without length or chunking ends when the connection does.
                response._complete(False)
            else:
                response._lost(exc)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as err:
            if self.response is not None:
                self.response._lost(ResetError(f"malformed response: {err}"))
            self.close()

    # httptools callbacks, forwarded to the response being read.

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None:
            self.response.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        if self.response is not None:
            self.response._head(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._body(body)

    def on_message_complete(self) -> None:
        if self.response is not None:
            self.response._complete(self.parser.should_keep_alive())

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Response:
    """One response as it arrives: ``status`` and ``headers``, then :meth:`read_chunk`."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_error",
        "_head_waiter",
        "_keep_alive",
        "_waiter",
        "done",
        "headers",
        "status",
    )

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self.done = False
        self._keep_alive = False
        self._error: BaseException | None = None
        self._head_waiter: asyncio.Future[None] | None = None
        self._waiter: asyncio.Future[None] | None = None

    # -- fed by the connection

    def _head(self, status: int) -> None:
        self.status = status
        _wake(self._head_waiter)

    def _body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _PAUSE_AT and self._conn.transport is not None:
            self._conn.transport.pause_reading()
        _wake(self._waiter)

    def _complete(self, keep_alive: bool) -> None:
        self.done = True
        self._keep_alive = keep_alive
        self._conn.response = None
        _wake(self._head_waiter)
        _wake(self._waiter)

    def _lost(self, exc: BaseException | None) -> None:
        if not self.done:
            self._error = ResetError(f"connection closed by the engine{f': {exc}' if exc else ''}")
        _wake(self._head_waiter)
        _wake(self._waiter)

    # -- for the proxy

    async def wait_head(self, deadline: float | None = None) -> None:
        """Until the status line and headers are in; TimeoutError past ``deadline``.

        ``deadline`` is on the event loop's clock (``loop.time()``): a timer only when
        there is something to wait for, and no task cancellation to undo.
        """
        if self.status or self.done:
            return
        if self._error is not None:
            raise self._error
        conn = self._conn
        waiter = self._head_waiter = conn.loop.create_future()
        if deadline is None:
            await waiter
        else:
            timeouts = conn.pool.timeouts
            timeouts.add(waiter, deadline, conn.loop)
            try:
                await waiter
            finally:
                timeouts.discard(waiter)
        if not self.status and self._error is not None:
            raise self._error

    @property
    def at_eof(self) -> bool:
        return self.done and not self._chunks

    async def read_chunk(self, deadline: float | None = None) -> bytes:
        """The next body bytes as they came; ``b""`` at the end of the body.

        TimeoutError when nothing came by ``deadline`` (event loop clock).
        """
        while True:
            if self._chunks:
                # What arrived since the last read goes out as one piece.
                if len(self._chunks) == 1:
                    chunk = self._chunks.popleft()
                else:
                    chunk = b"".join(self._chunks)
                    self._chunks.clear()
                if self._buffered > _PAUSE_AT and self._conn.transport is not None:
                    self._conn.transport.resume_reading()
                self._buffered = 0
                return chunk
            if self.done:
                return b""
            if self._error is not None:
                raise self._error
            conn = self._conn
            waiter = self._waiter = conn.loop.create_future()
            if deadline is None:
                await waiter
            else:
                timeouts = conn.pool.timeouts
                timeouts.add(waiter, deadline, conn.loop)
                try:
                    await waiter
                finally:
                    timeouts.discard(waiter)

    async def read(self, deadline: float | None = None) -> bytes:
        parts = []
        while chunk := await self.read_chunk(deadline):
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Return the connection to the pool if the response ended cleanly, else close it."""
        conn = self._conn
        if self.done and self._keep_alive and not self._chunks and not conn.closed:
            conn.pool.put(conn)
        else:
            self.close()

    def close(self) -> None:
        self._conn.response = None
        self._conn.close()


# How often waits with a deadline are checked (seconds): one timer for all of them, not
# one armed and cancelled per wait (uvloop's call_at is several thousand instructions).
_TICK = 0.05


class _Timeouts:
    """Waits that fail with TimeoutError past their deadline, within ``_TICK``."""

    __slots__ = ("_handle", "_loop", "_waits")

    def __init__(self) -> None:
        self._waits: dict[asyncio.Future[None], float] = {}
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(
        self, waiter: asyncio.Future[None], deadline: float, loop: asyncio.AbstractEventLoop
    ) -> None:
        self._waits[waiter] = deadline
        if self._handle is None:
            self._loop = loop
            self._handle = loop.call_later(_TICK, self._check)

    def discard(self, waiter: asyncio.Future[None]) -> None:
        self._waits.pop(waiter, None)

    def _check(self) -> None:
        loop = self._loop
        assert loop is not None
        now = loop.time()
        waits = self._waits
        for waiter in [w for w, at in waits.items() if at <= now]:
            del waits[waiter]
            if not waiter.done():
                waiter.set_exception(TimeoutError())
        self._handle = loop.call_later(_TICK, self._check) if waits else None

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class _HostPool:
    def __init__(
        self,
        host: str,
        port: int,
        tls: ssl.SSLContext | None,
        limit: int,
        keepalive: float,
        timeouts: _Timeouts,
    ) -> None:
        self.timeouts = timeouts
        self.host = host
        self.port = port
        self.tls = tls
        self.limit = limit
        self.keepalive = keepalive
        self.idle: list[_Connection] = []
        self.authority = f"{host}:{port}".encode()
        # Everything between the path and the content length is the same every time.
        self.request_line_tail = b" HTTP/1.1\r\nhost: " + self.authority + b"\r\ncontent-length: "

    def forget(self, conn: _Connection) -> None:
        if conn in self.idle:
            self.idle.remove(conn)

    def put(self, conn: _Connection) -> None:
        if self.limit and len(self.idle) >= self.limit:
            conn.close()
        else:
            conn.idle_since = time.monotonic()
            self.idle.append(conn)

    def take(self) -> _Connection | None:
        """The most recently used idle connection still worth trying."""
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive:
                return conn
            conn.close()
        return None

    async def connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(
                lambda: _Connection(self, loop),
                self.host,
                self.port,
                ssl=self.tls,
                server_hostname=self.host if self.tls else None,
            )
        except Exception as err:
            # OSError above all, but any failure to open the connection (a host name
            # the resolver chokes on: UnicodeError; a bad port: OverflowError) is a
            # connect failure: retried elsewhere, counted toward ejection, never a 500.
            raise ConnectError(
                f"cannot connect to {self.host}:{self.port}: {type(err).__name__}: {err}"
            ) from None
        return conn


class Pool:
    """Keep-alive connections per endpoint URL."""

    def __init__(self, *, per_endpoint: int = 0, keepalive: float = 60.0) -> None:
        self.per_endpoint = per_endpoint
        self.keepalive = keepalive
        self._hosts: dict[str, _HostPool] = {}
        self._tls: ssl.SSLContext | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timeouts = _Timeouts()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this pool serves (looked up once: a getpid() each on 3.11)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def _host(self, base_url: str) -> _HostPool:
        pool = self._hosts.get(base_url)
        if pool is None:
            try:
                parts = parse_endpoint_url(base_url)
            except ValueError as err:
                # Never dialled: not a default host or port, not a 500 either.
                raise ConnectError(str(err)) from None
            secure = parts.scheme == "https"
            if secure and self._tls is None:
                self._tls = ssl.create_default_context()
            pool = _HostPool(
                parts.host,
                parts.port,
                self._tls if secure else None,
                self.per_endpoint,
                self.keepalive,
                self._timeouts,
            )
            self._hosts[base_url] = pool
        return pool

    async def post(
        self,
        base_url: str,
        path: str,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        *,
        connect_timeout: float,
        deadline: float | None = None,
        api_key: str = "",
        method: str = "POST",
    ) -> Response:
        """Send the request and wait for the response head (until ``deadline``, loop clock).

        ``api_key``: the engine's secret, sent as ``Authorization: Bearer``; an
        Authorization among ``headers`` (the client's own key) never reaches the engine.
        """
        host = self._hosts.get(base_url) or self._host(base_url)
        parts = [
            b"POST " if method == "POST" else method.encode("ascii") + b" ",
            path.encode(),
            host.request_line_tail,
            b"%d\r\n" % len(body),
        ]
        for name, value in headers:
            if name.lower() == b"authorization":
                continue
            parts += (name, b": ", value, b"\r\n")
        if api_key:
            parts += (b"authorization: Bearer ", api_key.encode("ascii"), b"\r\n")
        parts.append(b"\r\n")
        head = b"".join(parts)
        # A pooled connection the engine closed meanwhile fails before any byte
        # of response: that is not the engine's fault, so try a fresh one.
        while (conn := host.take()) is not None:
            response = self._send(conn, head, body)
            try:
                await response.wait_head(deadline)
            except ResetError:
                response.close()
                if response.status or response._chunks:
                    raise
                continue
            except BaseException:
                # Cancelled or timed out while the engine works on it: closing the
                # connection is what stops the engine.
                response.close()
                raise
            return response
        try:
            async with asyncio.timeout(connect_timeout):
                conn = await host.connect()
        except TimeoutError:
            raise ConnectError(f"connect to {host.host}:{host.port} timed out") from None
        response = self._send(conn, head, body)
        try:
            await response.wait_head(deadline)
        except BaseException:
            response.close()
            raise
        return response

    @staticmethod
    def _send(conn: _Connection, head: bytes, body: bytes) -> Response:
        response = Response(conn)
        conn.response = response
        # One parser per connection: after a complete keep-alive response it reads the
        # next one (only a connection that ended cleanly comes back from the pool).
        assert conn.transport is not None
        conn.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            conn.transport.write(body)
        return response

    def close(self) -> None:
        self._timeouts.close()
        for host in self._hosts.values():
            for conn in host.idle:
                conn.close()
            host.idle.clear()
