"""A lean HTTP/1.1 server on asyncio protocols.

The simulator must never be what limits a router benchmark, and a general web
framework spends most of its time per request on machinery the simulator does
not need.  This server does just what the engines' HTTP front ends do for
llmgw: keep-alive, pipelining, Content-Length and chunked request bodies,
``Expect: 100-continue``, chunked streaming responses, cancelling a handler
when its client goes away, and a graceful shutdown that stops listening, closes
idle connections and gives running handlers a grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import cast

MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024

_REASONS = {s.value: s.phrase for s in HTTPStatus}


class Request:
    __slots__ = (
        "body",
        "conn",
        "headers",
        "keep_alive",
        "method",
        "path",
        "peer",
        "query",
        "version",
    )

    def __init__(
        self,
        method: str,
        path: str,
        query: str,
        version: str,
        headers: dict[str, str],
        body: bytes,
        conn: HttpConnection,
    ) -> None:
        self.conn = conn
        self.method = method
        self.path = path
        self.query = query
        self.version = version
        # Names are lower-cased; look headers up with lower-case names.
        self.headers = headers
        self.body = body
        self.peer = conn.peer
        connection = headers.get("connection", "").lower()
        if version == "HTTP/1.0":
            self.keep_alive = "keep-alive" in connection
        else:
            self.keep_alive = "close" not in connection


class Response:
    __slots__ = ("body", "headers", "status")

    def __init__(
        self,
        status: int = 200,
        body: bytes = b"",
        content_type: str | None = None,
        headers: dict[str, str] | None = None,
        text: str | None = None,
    ) -> None:
        self.status = status
        if text is not None:
            body = text.encode()
            content_type = content_type or "text/plain; charset=utf-8"
        self.body = body
        self.headers = dict(headers or {})
        if content_type is not None:
            self.headers["Content-Type"] = content_type


class Stream:
    """A chunked (streaming) response; handlers that use it return it when done."""

    __slots__ = ("_conn", "_head", "_started", "done", "keep_alive")

    def __init__(self, request: Request, keep_alive: bool = True) -> None:
        self._conn = request.conn
        self._head = b""
        self._started = False
        self.done = False
        self.keep_alive = keep_alive

    def prepare(self, status: int, headers: dict[str, str], *, send_now: bool = True) -> None:
        """Set the status line and headers; without ``send_now`` they go out with the
        first body write (one write instead of two for a stream sent in one piece)."""
        extra = {"Transfer-Encoding": "chunked", **headers}
        self._conn.status = status
        self._head = self._conn.server.head(status, extra, None, self.keep_alive)
        if send_now:
            self._conn.write(self._head)
            self._head = b""
        self._started = True

    async def write(self, data: bytes) -> None:
        if not data:
            return
        self._conn.write(self._head + b"%x\r\n" % len(data) + data + b"\r\n")
        self._head = b""
        await self._conn.drain()

    async def write_eof(self, data: bytes = b"") -> None:
        chunk = b"%x\r\n%s\r\n" % (len(data), data) if data else b""
        self._conn.write(self._head + chunk + b"0\r\n\r\n")
        self._head = b""
        self.done = True
        await self._conn.drain()


Handler = Callable[[Request], Awaitable["Response | Stream"]]


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class HttpConnection(asyncio.Protocol):
    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.busy = False
        self.closing = False
        self.task: asyncio.Task[None] | None = None
        self.peer = "-"
        self._continue_sent = False
        self._paused = False
        self._drain: asyncio.Future[None] | None = None
        # Whether the current request has written anything yet, and its status.
        self.wrote = False
        self.status = 0

    # ----- asyncio.Protocol -------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but behave as one.
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.peer = f"{peer[0]}:{peer[1]}"
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.server.connections.discard(self)
        if self.task is not None and not self.task.done():
            # The client went away: the handler stops, as with a real engine.
            self.task.cancel()
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("connection lost"))

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._next()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    # ----- writing ----------------------------------------------------------

    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("client connection closed")
        self.wrote = True
        transport.write(data)

    async def drain(self) -> None:
        if self.closing:
            raise ConnectionResetError("client connection closed")
        if self._paused:
            if self._drain is None:
                self._drain = asyncio.get_running_loop().create_future()
            await self._drain

    def close(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    # ----- requests ---------------------------------------------------------

    def _next(self) -> None:
        while not self.busy and not self.closing and self.buf:
            try:
                req = self._parse()
            except _BadRequest as err:
                self.write_simple(err.status, str(err))
                self.close()
                return
            if req is None:
                return
            self.busy = True
            self.task = self.server.loop.create_task(self._run(req))

    def write_simple(self, status: int, message: str) -> None:
        self.status = status
        body = message.encode()
        head = self.server.head(status, {"Content-Type": "text/plain"}, len(body), False)
        with contextlib.suppress(ConnectionError):
            self.write(head + body)

    def _parse(self) -> Request | None:
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > MAX_HEADER_BYTES:
                raise _BadRequest(431, "Request Header Fields Too Large")
            return None
        try:
            head = bytes(buf[:end]).decode("latin-1")
        except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes anything
            raise _BadRequest(400, "Bad Request") from None
        lines = head.split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _BadRequest(400, "Bad Request: malformed request line")
        method, target, version = parts
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise _BadRequest(400, "Bad Request: malformed header line")
            key = name.lower()
            value = value.strip()
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        start = end + 4
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body, consumed = self._chunked(start)
            if body is None:
                self._maybe_continue(headers)
                return None
        else:
            raw = headers.get("content-length", "0")
            try:
                length = int(raw)
            except ValueError:
                raise _BadRequest(400, "Bad Request: invalid Content-Length") from None
            if length < 0:
                raise _BadRequest(400, "Bad Request: invalid Content-Length")
            if length > MAX_BODY_BYTES:
                raise _BadRequest(413, "Request Entity Too Large")
            if len(buf) - start < length:
                self._maybe_continue(headers)
                return None
            body = bytes(buf[start : start + length])
            consumed = start + length
        del buf[:consumed]
        self._continue_sent = False
        path, _, query = target.partition("?")
        if path.startswith(("http://", "https://")):
            # Absolute-form target (as sent to proxies): keep the path only.
            path = "/" + path.split("/", 3)[3] if path.count("/") >= 3 else "/"
        return Request(method, path, query, version, headers, body, self)

    def _chunked(self, pos: int) -> tuple[bytes | None, int]:
        buf = self.buf
        out = bytearray()
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                return None, 0
            size_text = bytes(buf[pos:eol]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise _BadRequest(400, "Bad Request: invalid chunk size") from None
            pos = eol + 2
            if size == 0:
                # Trailers (usually none) end with an empty line.
                trailer_end = buf.find(b"\r\n", pos)
                while trailer_end > pos:
                    pos = trailer_end + 2
                    trailer_end = buf.find(b"\r\n", pos)
                if trailer_end < 0:
                    return None, 0
                return bytes(out), trailer_end + 2
            if len(buf) < pos + size + 2:
                return None, 0
            out += buf[pos : pos + size]
            if len(out) > MAX_BODY_BYTES:
                raise _BadRequest(413, "Request Entity Too Large")
            pos += size + 2

    def _maybe_continue(self, headers: dict[str, str]) -> None:
        if not self._continue_sent and headers.get("expect", "").lower() == "100-continue":
            self._continue_sent = True
            with contextlib.suppress(ConnectionError):
                self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    async def _run(self, req: Request) -> None:
        server = self.server
        keep_alive = req.keep_alive and not server.draining
        self.wrote = False
        self.status = 0
        try:
            result = await server.handler(req)
            if isinstance(result, Stream):
                keep_alive = keep_alive and result.keep_alive
                if not result.done:
                    await result.write_eof()
            else:
                self.status = result.status
                # Decided now: a drain may have begun while the handler ran.
                keep_alive = (
                    keep_alive and not server.draining and "Connection" not in result.headers
                )
                head = server.head(result.status, result.headers, len(result.body), keep_alive)
                body = b"" if req.method == "HEAD" else result.body
                if len(body) < 65536:
                    self.write(head + body)
                else:
                    self.write(head)
                    self.write(body)
        except asyncio.CancelledError:
            keep_alive = False
            if not self.closing and not self.wrote:
                # Cancelled by shutdown while the client still waits.
                self.write_simple(503, "Service Unavailable")
        except ConnectionError:
            keep_alive = False
        except Exception:
            keep_alive = False
            server.logger.exception("unhandled error in request handler")
            if not self.wrote:
                self.write_simple(500, "Internal Server Error")
        finally:
            self.task = None
            self.busy = False
        if server.access_logger is not None:
            # Like uvicorn: the status sent, even if the client left mid-stream.
            status = self.status or 500
            reason = _REASONS.get(status, "")
            server.access_logger.info(
                'INFO:     %s - "%s %s %s" %d %s',
                req.peer,
                req.method,
                req.path,
                req.version,
                status,
                reason,
            )
        if not keep_alive or self.server.draining:
            self.close()
        elif self.buf:
            self._next()


class HttpServer:
    """Serves ``handler`` on a listening socket; :meth:`shutdown` stops it gracefully."""

    def __init__(
        self,
        handler: Handler,
        *,
        server_header: str | None = None,
        access_logger: logging.Logger | None = None,
        name: str | None = None,
    ) -> None:
        self.handler = handler
        self.connections: set[HttpConnection] = set()
        self.draining = False
        self.access_logger = access_logger
        self.logger = logging.getLogger("llmgw_sim.http")
        self._server_line = f"server: {server_header}\r\n".encode() if server_header else b""
        if name is not None:  # --sim-name: on every answer
            self._server_line += f"x-sim-name: {name}\r\n".encode("latin-1")
        self._server: asyncio.AbstractServer | None = None
        self._date = b""
        self._date_at = 0
        self.loop = asyncio.get_running_loop()

    def _date_line(self) -> bytes:
        now = int(time.time())
        if now != self._date_at:
            self._date_at = now
            self._date = f"date: {email.utils.formatdate(now, usegmt=True)}\r\n".encode()
        return self._date

    def head(
        self, status: int, headers: dict[str, str], length: int | None, keep_alive: bool
    ) -> bytes:
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, "Unknown").encode())]
        lines.append(self._date_line())
        lines.append(self._server_line)
        for name, value in headers.items():
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        if length is not None:
            lines.append(b"content-length: %d\r\n" % length)
        if not keep_alive and "Connection" not in headers:
            lines.append(b"connection: close\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    async def start(self, sock: socket.socket, backlog: int = 2048) -> None:
        self._server = await self.loop.create_server(
            lambda: HttpConnection(self), sock=sock, backlog=backlog
        )

    async def shutdown(self, grace: float) -> None:
        """Stop listening, close idle connections, let running handlers finish
        within ``grace`` seconds, then cancel them and close everything."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if not conn.busy:
                conn.close()
        tasks = [c.task for c in self.connections if c.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=grace)
        for conn in list(self.connections):
            if conn.task is not None and not conn.task.done():
                conn.task.cancel()
        await asyncio.sleep(0)
        for conn in list(self.connections):
            conn.close()
