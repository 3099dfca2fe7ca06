"""The agent's one outbound stream to the control plane (AgentService/Connect).

The agent dials, sends Register (inventory, labels, every running shard), waits
for RegisterAck, then heartbeats at the interval the ack gives while it answers
commands. Status changes and command results go through an :class:`Outbox` that
outlives any one stream, so what happened while the control plane was away is
delivered after the next Register. It reconnects forever with full-jitter
backoff, reset once a stream has stayed up a while.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ssl
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpclib.const
import structlog
from grpclib.client import Channel, Stream
from grpclib.config import Configuration
from llmgw_proto import v1
from llmgw_proto.backoff import Backoff
from llmgw_proto.tls import CertReloader

from llmgw_agent.adapters import split_host_port
from llmgw_agent.config import AgentConfig

__all__ = ["CONNECT", "CommandHandler", "ControlLink", "Outbox"]

log = structlog.get_logger(__name__)

CONNECT = "/llmgw.v1.AgentService/Connect"
DEFAULT_HEARTBEAT = 2.0

AgentStream = Stream[v1.AgentMessage, v1.ControlMessage]


class CommandHandler(Protocol):
    def start(self, start: v1.StartShard) -> v1.CommandResult: ...
    def stop(self, stop: v1.StopShard) -> v1.CommandResult: ...
    def drain(self, drain: v1.DrainShard) -> v1.CommandResult: ...


class Outbox:
    """Messages that must reach the control plane, kept across reconnects, in order."""

    def __init__(self, limit: int = 10_000) -> None:
        self._items: deque[v1.AgentMessage] = deque()
        self._limit = limit
        self._changed = asyncio.Event()
        self._empty = asyncio.Event()
        self._empty.set()
        self.dropped = 0

    def put(self, message: v1.AgentMessage) -> None:
        if len(self._items) >= self._limit:
            # Away for very long: the oldest transitions matter least (Register has the truth).
            self._items.popleft()
            self.dropped += 1
        self._items.append(message)
        self._changed.set()
        self._empty.clear()

    def status(self, status: v1.ShardStatus) -> None:
        self.put(v1.AgentMessage(shard_status=status))

    def peek(self) -> v1.AgentMessage | None:
        return self._items[0] if self._items else None

    def pop(self) -> None:
        self._items.popleft()
        if not self._items:
            self._empty.set()

    async def flushed(self) -> None:
        """Until everything put so far has been sent."""
        await self._empty.wait()

    def __len__(self) -> int:
        return len(self._items)

    def wake(self) -> None:
        """Wake a sender waiting in :meth:`wait` without adding anything."""
        self._changed.set()

    async def wait(self, timeout: float) -> None:
        """Until something is put, or ``timeout`` seconds pass."""
        if self._items:
            return
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(timeout, 0.0)):
                await self._changed.wait()


class RegisterRefused(Exception):
    """The control plane answered Register with something other than RegisterAck."""


@dataclass
class ControlLink:
    config: AgentConfig
    handler: CommandHandler
    outbox: Outbox
    # Builds the Register for a new stream: inventory and running shards of this moment.
    register: Callable[[], v1.Register]
    usage: Callable[[], list[v1.GpuUsage]]
    ssl_context: ssl.SSLContext | None = None
    # Re-reads rotated certificate files into ssl_context before each new stream.
    reloader: CertReloader | None = None
    backoff: Backoff | None = None
    connected: asyncio.Event = field(default_factory=asyncio.Event)
    session_id: str = ""
    sessions: int = 0
    # Each reconnect delay drawn, for logs and tests.
    delays: list[float] = field(default_factory=list)
    heartbeats_sent: int = 0
    _closing: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        if self.backoff is None:
            self.backoff = Backoff(self.config.base_backoff, self.config.max_backoff)

    async def run(self) -> None:
        """Connect, serve the stream, reconnect: forever (until cancelled)."""
        assert self.backoff is not None
        loop = asyncio.get_running_loop()
        while not self._closing.is_set():
            up_since: list[float] = []
            try:
                await self._session(up_since)
                log.warning("control plane closed the stream", address=self.config.control.address)
            except asyncio.CancelledError:
                raise
            except Exception as err:
                log.warning(
                    "stream to the control plane failed",
                    address=self.config.control.address,
                    error=f"{type(err).__name__}: {err}",
                )
            finally:
                self.connected.clear()
            if self._closing.is_set():
                return
            if up_since and loop.time() - up_since[0] >= self.config.stable_after:
                self.backoff.reset()
            delay = self.backoff.next()
            self.delays.append(delay)
            log.info("reconnecting", delay=round(delay, 3), attempt=self.backoff.attempt)
            await asyncio.sleep(delay)

    async def close(self, task: asyncio.Task[None], timeout: float) -> None:
        """End ``task`` (running :meth:`run`) gracefully: send what is queued, half-close
        the stream, and wait for the control plane to end it, so it has read everything.
        """
        self._closing.set()
        self.outbox.wake()
        if self.connected.is_set():
            with contextlib.suppress(TimeoutError, Exception):
                async with asyncio.timeout(timeout):
                    await asyncio.shield(task)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task

    async def _session(self, up_since: list[float]) -> None:
        if self.reloader is not None:
            self.reloader.check()
        host, port = split_host_port(self.config.control.address)
        channel = Channel(
            host,
            port,
            ssl=self.ssl_context,
            # Pings find a control plane that vanished without closing the connection.
            config=Configuration(
                _keepalive_time=10.0,
                _keepalive_timeout=20.0,
                _keepalive_permit_without_calls=True,
            ),
        )
        try:
            async with channel.request(
                CONNECT,
                grpclib.const.Cardinality.STREAM_STREAM,
                v1.AgentMessage,
                v1.ControlMessage,
            ) as stream:
                await self._serve(stream, up_since)
        finally:
            channel.close()

    async def _serve(self, stream: AgentStream, up_since: list[float]) -> None:
        await stream.send_request()
        register = self.register()
        await stream.send_message(v1.AgentMessage(register=register))
        async with asyncio.timeout(self.config.control.register_timeout):
            first = await stream.recv_message()
        if first is None or first.register_ack is None:
            raise RegisterRefused(f"expected RegisterAck, got {first!r}")
        ack = first.register_ack
        interval = (
            ack.heartbeat_interval.total_seconds() if ack.heartbeat_interval else DEFAULT_HEARTBEAT
        ) or DEFAULT_HEARTBEAT
        self.session_id = ack.session_id
        self.sessions += 1
        up_since.append(asyncio.get_running_loop().time())
        self.connected.set()
        log.info(
            "registered with the control plane",
            session=ack.session_id,
            heartbeat_interval=interval,
            shards=len(register.shards),
            queued=len(self.outbox),
        )
        sender = asyncio.create_task(self._send(stream, interval), name="agent stream send")
        receiver = asyncio.create_task(self._receive(stream), name="agent stream receive")
        try:
            done, _ = await asyncio.wait({sender, receiver}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a failure ends the session with its error
        finally:
            for task in (sender, receiver):
                task.cancel()
            for task in (sender, receiver):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _send(self, stream: AgentStream, interval: float) -> None:
        """The only writer of the stream: queued messages first, heartbeats when due."""
        loop = asyncio.get_running_loop()
        next_heartbeat = loop.time()
        sequence = 0
        while True:
            while (message := self.outbox.peek()) is not None:
                await stream.send_message(message)
                self.outbox.pop()  # only once sent: a broken stream keeps it for the next
            if self._closing.is_set():
                # Everything queued is sent: half-close, and let the receiver see the end.
                await stream.end()
                await asyncio.Future()
            now = loop.time()
            if now >= next_heartbeat:
                sequence += 1
                heartbeat = v1.Heartbeat(
                    sequence=sequence,
                    gpus=self.usage(),
                    sent_at=datetime.datetime.now(datetime.UTC),
                )
                await stream.send_message(v1.AgentMessage(heartbeat=heartbeat))
                self.heartbeats_sent += 1
                next_heartbeat = now + interval
                continue
            await self.outbox.wait(next_heartbeat - now)

    async def _receive(self, stream: AgentStream) -> None:
        while True:
            message = await stream.recv_message()
            if message is None:
                return
            result = self._dispatch(message)
            if result is not None:
                self.outbox.put(v1.AgentMessage(command_result=result))

    def _dispatch(self, message: v1.ControlMessage) -> v1.CommandResult | None:
        if message.start_shard is not None:
            start = message.start_shard
            log.info("command: start", command=start.command_id, shard=start.shard_id)
            return self.handler.start(start)
        if message.stop_shard is not None:
            stop = message.stop_shard
            log.info("command: stop", command=stop.command_id, shard=stop.shard_id)
            return self.handler.stop(stop)
        if message.drain_shard is not None:
            drain = message.drain_shard
            log.info("command: drain", command=drain.command_id, shard=drain.shard_id)
            return self.handler.drain(drain)
        log.warning("ignoring unexpected message from the control plane", message=repr(message))
        return None
