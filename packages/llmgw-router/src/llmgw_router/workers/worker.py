"""In a worker: its place among the others, its socket, and ejection sharing.

What server.py needs to run as one worker of several; nothing here imports the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import socket
import time
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import structlog
from llmgw_proto.addr import parse_hostport

from llmgw_router.config import RouterConfig

__all__ = ["EjectionShare", "WorkerContext", "reuseport_socket", "worker_count"]

log = structlog.get_logger(__name__)


def worker_count(cfg: RouterConfig) -> int:
    """`workers` from the config; unset: one per core this process may run on."""
    if cfg.workers is not None:
        return cfg.workers
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def reuseport_socket(
    address: str, *, listen: bool, backlog: int = 4096, reuse_port: bool = True
) -> socket.socket:
    """A TCP socket bound to ``address`` with SO_REUSEPORT (listening if asked)."""
    host, port = parse_hostport(address, default_host="0.0.0.0", allow_port_zero=True)
    family, kind, proto, _, addr = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
        if listen:
            sock.listen(backlog)
            sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


@dataclass(frozen=True)
class WorkerContext:
    """What makes a router process one worker of several."""

    index: int
    workers: int
    runtime_dir: str

    @property
    def admin_socket(self) -> str:
        return os.path.join(self.runtime_dir, f"w{self.index}.admin")

    @property
    def peer_socket(self) -> str:
        return os.path.join(self.runtime_dir, f"w{self.index}.peer")


class _Ejection(msgspec.Struct, array_like=True):
    id: str
    url: str
    # time.monotonic() is CLOCK_MONOTONIC, the same clock in every process of a host.
    until: float
    ejections: int


_encode_ejection = msgspec.msgpack.Encoder().encode
_decode_ejection = msgspec.msgpack.Decoder(_Ejection).decode


class EjectionShare:
    """Tells the other workers of every ejection this one makes, and applies theirs.

    Ejections are found by looking, ten times a second, at the endpoints' outlier
    state rather than by a hook in the proxy: whatever ejects an endpoint, the others
    hear of it. An ejection from a peer sets the same `ejected_until` here.
    """

    def __init__(self, state: Any, context: WorkerContext, interval: float = 0.1) -> None:
        self.state = state
        self.context = context
        self.interval = interval
        # Per endpoint id: the ejection already sent or applied (its ejected_until).
        self._known: dict[str, float] = {}
        with contextlib.suppress(FileNotFoundError):
            os.unlink(context.peer_socket)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(context.peer_socket)
        self.sock.setblocking(False)
        self.received = 0

    def _peers(self) -> list[str]:
        own = self.context.peer_socket
        return [p for p in glob.glob(os.path.join(self.context.runtime_dir, "w*.peer")) if p != own]

    def broadcast(self, ep: Any) -> None:
        message = _encode_ejection(
            _Ejection(ep.id, ep.url, ep.outlier.ejected_until, ep.outlier.ejections)
        )
        for peer in self._peers():
            # A peer that is gone or restarting misses it; its own failures will tell it.
            with contextlib.suppress(OSError):
                self.sock.sendto(message, peer)

    def apply(self, message: _Ejection) -> bool:
        for ep in self.state.endpoints.endpoints:
            if ep.id == message.id and ep.url == message.url:
                self._known[ep.id] = max(self._known.get(ep.id, 0.0), message.until)
                if ep.outlier.ejected_until >= message.until:
                    return False
                ep.outlier = replace(
                    ep.outlier,
                    consecutive_failures=0,
                    ejected_until=message.until,
                    ejections=max(ep.outlier.ejections, message.ejections),
                    last_ejected_at=time.monotonic(),
                )
                log.info(
                    "endpoint ejected by another worker",
                    endpoint=ep.id,
                    seconds=round(message.until - time.monotonic(), 3),
                )
                return True
        return False

    def _on_readable(self) -> None:
        while True:
            try:
                data = self.sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            try:
                message = _decode_ejection(data)
            except msgspec.DecodeError:
                continue
            self.received += 1
            self.apply(message)

    def scan(self, now: float) -> None:
        known = self._known
        for ep in self.state.endpoints.endpoints:
            until = ep.outlier.ejected_until
            if until > now and until > known.get(ep.id, 0.0):
                known[ep.id] = until
                self.broadcast(ep)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(self.sock.fileno(), self._on_readable)
        try:
            while True:
                self.scan(time.monotonic())
                await asyncio.sleep(self.interval)
        finally:
            loop.remove_reader(self.sock.fileno())
            self.sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.context.peer_socket)
