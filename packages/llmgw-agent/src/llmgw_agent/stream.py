"""The agent's one outbound stream to the control plane (AgentService/Connect).

The agent dials, sends Register (inventory, labels, engines, every running shard), waits
for RegisterAck, then heartbeats at the interval the ack gives while it answers
commands. Status changes and command results go through an :class:`Outbox` that
outlives any one stream, so what happened while the control plane was away is
delivered after the next Register. It reconnects forever with full-jitter
backoff, reset once a stream has stayed up a while.

High availability: ``control.addresses`` are tried in turn; a standby answers
UNAVAILABLE with the leader's address in the trailing metadata ``llmgw-leader``, and
the agent dials that next. Fencing: every RegisterAck and command carries the leader's
epoch; a command older than the newest epoch seen is refused (CommandResult ok=false),
never acted on, so a deposed leader with a stream still open cannot start or stop
anything. A PERMISSION_DENIED (a certificate for another node) is logged once, clearly,
and retried at the longest backoff.
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
from grpclib.client import Stream
from grpclib.exceptions import GRPCError
from llmgw_proto import v1
from llmgw_proto.addr import parse_hostport
from llmgw_proto.backoff import Backoff
from llmgw_proto.grpc_limits import DEFAULT_MAX_MESSAGE, BoundedChannel, log_too_large
from llmgw_proto.keepalive import keepalive
from llmgw_proto.tls import CertReloader
from llmgw_proto.tls_probe import mismatch, speaks_tls

from llmgw_agent.config import AgentConfig
from llmgw_agent.logs import LogSubscriptions
from llmgw_agent.lora import AdapterCommands

__all__ = ["CONNECT", "CommandHandler", "ControlLink", "Outbox"]

log = structlog.get_logger(__name__)


_too_large = log_too_large(log, "message from the control plane refused: too large")


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


LEADER_METADATA = "llmgw-leader"


def _leader_named(stream: AgentStream) -> str:
    """The ``llmgw-leader`` a standby put in its trailers-only answer, or ""."""
    for metadata in (stream.trailing_metadata, stream.initial_metadata):
        if metadata is not None and metadata.get(LEADER_METADATA):
            return str(metadata[LEADER_METADATA])
    # A standby ends the call before the agent's Register is sent; grpclib then raises
    # the status from the raw headers without decoding their metadata: read them here.
    raw = getattr(getattr(stream, "_stream", None), "headers", None) or []
    for name, value in raw:
        if (name.decode() if isinstance(name, bytes) else name) == LEADER_METADATA:
            return value.decode() if isinstance(value, bytes) else str(value)
    return ""


class LeaderElsewhere(Exception):
    """A standby refused the stream and named the leader."""

    def __init__(self, leader: str, error: GRPCError) -> None:
        super().__init__(f"{error.message or error.status.name}; the leader is {leader}")
        self.leader = leader


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
    # The newest leader epoch seen (RegisterAck or command); older commands are refused.
    epoch: int = 0
    # How often engines' metrics are read: RegisterAck.load_interval, else agent.yaml.
    load_interval: float = 0.0
    # The address of the current (or last) stream.
    address: str = ""
    # LoRA adapters' LoadAdapter/UnloadAdapter (answered once the engine answers).
    adapters: AdapterCommands | None = None
    # Engine logs asked by the control plane (llmgw-control logs; llmgw_agent.logs).
    logs: LogSubscriptions | None = None
    _closing: asyncio.Event = field(default_factory=asyncio.Event)
    _addresses: list[str] = field(default_factory=list)
    _next: int = 0
    _leader: str = ""
    _denied_logged: bool = False
    # Addresses already found to disagree with this agent on TLS (said once each).
    _mismatched: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.backoff is None:
            self.backoff = Backoff(self.config.base_backoff, self.config.max_backoff)
        self._addresses = self.config.control_addresses()
        self.load_interval = self.load_interval or self.config.load_interval

    def _target(self) -> str:
        """The leader a standby named, else the next configured address in turn."""
        if self._leader:
            leader, self._leader = self._leader, ""
            return leader
        address = self._addresses[self._next % len(self._addresses)]
        self._next += 1
        return address

    async def run(self) -> None:
        """Connect, serve the stream, reconnect: forever (until cancelled)."""
        assert self.backoff is not None
        loop = asyncio.get_running_loop()
        while not self._closing.is_set():
            up_since: list[float] = []
            delay: float | None = None
            self.address = self._target()
            try:
                await self._session(up_since)
                log.warning("control plane closed the stream", address=self.address)
            except asyncio.CancelledError:
                raise
            except LeaderElsewhere as err:
                log.info("control plane is a standby", address=self.address, leader=err.leader)
                self._leader = err.leader
                delay = self.config.base_backoff  # go to the leader without the long wait
            except GRPCError as err:
                if err.status == grpclib.const.Status.PERMISSION_DENIED:
                    # Retrying fast cannot help: the certificate is for another node.
                    if not self._denied_logged:
                        log.error(
                            "the control plane refused this node: PERMISSION_DENIED; check "
                            "node_id in agent.yaml against the name in control.tls.cert; "
                            "retrying every max_backoff",
                            address=self.address,
                            node=self.config.node_name,
                            reason=err.message or "",
                        )
                        self._denied_logged = True
                    delay = self.config.max_backoff
                else:
                    log.warning(
                        "stream to the control plane failed",
                        address=self.address,
                        error=f"{err.status.name}: {err.message or ''}",
                    )
                    if not up_since:
                        await self._tls_mismatch()
            except Exception as err:
                log.warning(
                    "stream to the control plane failed",
                    address=self.address,
                    error=f"{type(err).__name__}: {err}",
                )
                if not up_since:
                    await self._tls_mismatch()
            finally:
                self.connected.clear()
            if self._closing.is_set():
                return
            if up_since:
                self._denied_logged = False
            if up_since and loop.time() - up_since[0] >= self.config.stable_after:
                self.backoff.reset()
            if delay is None:
                if self._next % len(self._addresses) and not up_since:
                    delay = 0.0  # another configured address to try before backing off
                else:
                    delay = self.backoff.next()
            self.delays.append(delay)
            log.info("reconnecting", delay=round(delay, 3), attempt=self.backoff.attempt)
            await asyncio.sleep(delay)

    async def _tls_mismatch(self) -> None:
        """A stream that never came up: ask whether the control plane speaks TLS, and say
        so in words when it and this agent disagree (both sides see only a reset)."""
        if self.address in self._mismatched:
            return
        try:
            host, port = parse_hostport(self.address)
        except ValueError:
            return
        words = mismatch(self.address, self.ssl_context is not None, await speaks_tls(host, port))
        if words:
            self._mismatched.add(self.address)
            log.error(words, address=self.address)

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
        host, port = parse_hostport(self.address)
        channel = BoundedChannel(
            host,
            port,
            ssl=self.ssl_context,
            # Commands and acks are small: gRPC's usual 4 MiB bound on what is read.
            max_message=DEFAULT_MAX_MESSAGE,
            on_refused=_too_large,
            # Pings find a control plane that froze or vanished without closing the
            # connection: one unanswered for keepalive_timeout ends the stream.
            config=keepalive(self.config.control.keepalive, self.config.control.keepalive_timeout),
        )
        opened: list[AgentStream] = []
        try:
            async with channel.request(
                CONNECT,
                grpclib.const.Cardinality.STREAM_STREAM,
                v1.AgentMessage,
                v1.ControlMessage,
            ) as stream:
                opened.append(stream)
                await self._serve(stream, up_since)
        except GRPCError as err:
            # A standby ends the call at once; its status arrives when the call closes.
            leader = _leader_named(opened[0]) if opened else ""
            if err.status == grpclib.const.Status.UNAVAILABLE and leader:
                raise LeaderElsewhere(str(leader), err) from None
            raise
        finally:
            channel.close()

    async def _serve(self, stream: AgentStream, up_since: list[float]) -> None:
        if self.logs is not None:
            self.logs.reset()  # nobody reads what the last stream asked for
        await stream.send_request()
        register = self.register()
        await stream.send_message(v1.AgentMessage(register=register))
        async with asyncio.timeout(self.config.control.register_timeout):
            first = await stream.recv_message()
        if first is None or first.register_ack is None:
            raise RegisterRefused(f"expected RegisterAck, got {first!r}")
        ack = first.register_ack
        if ack.epoch < self.epoch:
            raise RegisterRefused(
                f"RegisterAck from epoch {ack.epoch}, older than epoch {self.epoch} "
                "already seen: a deposed leader"
            )
        self.epoch = ack.epoch
        if ack.load_interval is not None and ack.load_interval.total_seconds() > 0:
            self.load_interval = ack.load_interval.total_seconds()
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
            address=self.address,
            epoch=ack.epoch,
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

    def _fenced(self, command_id: str, epoch: int) -> v1.CommandResult | None:
        """A refusal when ``epoch`` is older than the newest seen; otherwise None."""
        if epoch < self.epoch:
            reason = (
                f"refused: command from leader epoch {epoch}, older than epoch "
                f"{self.epoch} already seen (a deposed leader)"
            )
            log.warning("fenced command", command=command_id, epoch=epoch, newest=self.epoch)
            return v1.CommandResult(command_id=command_id, ok=False, error=reason)
        self.epoch = epoch
        return None

    def _dispatch(self, message: v1.ControlMessage) -> v1.CommandResult | None:
        if self.logs is not None and self.logs.handle(message):
            return None
        if message.start_shard is not None:
            start = message.start_shard
            log.info("command: start", command=start.command_id, shard=start.shard_id)
            return self._fenced(start.command_id, start.epoch) or self.handler.start(start)
        if message.stop_shard is not None:
            stop = message.stop_shard
            log.info("command: stop", command=stop.command_id, shard=stop.shard_id)
            return self._fenced(stop.command_id, stop.epoch) or self.handler.stop(stop)
        if message.drain_shard is not None:
            drain = message.drain_shard
            log.info("command: drain", command=drain.command_id, shard=drain.shard_id)
            return self._fenced(drain.command_id, drain.epoch) or self.handler.drain(drain)
        adapter = message.load_adapter or message.unload_adapter
        if adapter is not None:
            log.info("command: adapter", command=adapter.command_id, shard=adapter.shard_id)
            refused = self._fenced(adapter.command_id, adapter.epoch)
            if refused is not None:
                return refused
            if self.adapters is None:
                return v1.CommandResult(
                    command_id=adapter.command_id, ok=False, error="this agent loads no adapters"
                )
            self.adapters.submit(
                message, lambda r: self.outbox.put(v1.AgentMessage(command_result=r))
            )
            return None
        log.warning("ignoring unexpected message from the control plane", message=repr(message))
        return None
