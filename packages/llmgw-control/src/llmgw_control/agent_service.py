"""AgentService.Connect: one bidirectional stream per node, and the command dispatcher.

The handler takes grpclib's raw stream (not betterproto2's generated one) because
the control plane must push commands at any moment, from the reconciler's task,
and must see the peer (address now, certificate once mTLS identities arrive). Per
stream, one task reads what the agent says and one writes what control queued; a
newer stream for the same node closes the older one.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpclib.const
import grpclib.server
import structlog
from grpclib.exceptions import GRPCError
from llmgw_proto import v1
from llmgw_proto.grpc_limits import MessageTooLarge
from llmgw_proto.tls import PeerIdentity, UnreadableIdentity, read_identity

from llmgw_control.bounds import Bounds, register_problem
from llmgw_control.metrics import Metrics
from llmgw_control.wire import MalformedMessage, recv

__all__ = ["AgentEvents", "AgentService", "Session"]

log = structlog.get_logger(__name__)

Stream = grpclib.server.Stream[v1.AgentMessage, v1.ControlMessage]


class AgentEvents(Protocol):
    """What the stream handler tells the rest of the control plane."""

    def on_register(self, session: Session, msg: v1.Register) -> None: ...
    def on_heartbeat(self, session: Session, msg: v1.Heartbeat) -> None: ...
    def on_shard_status(self, session: Session, msg: v1.ShardStatus) -> None: ...
    def on_disconnect(self, session: Session) -> None: ...
    def on_load_report(self, session: Session, msg: v1.LoadReport) -> None: ...
    def on_cache_events(self, session: Session, msg: v1.CacheEvents) -> None: ...
    def on_command_result(
        self, node_id: str, command_id: str, ok: bool, error: str, *, answered: bool
    ) -> None: ...


@dataclass(eq=False)
class Session:
    node_id: str
    session_id: str
    peer_host: str
    outbox: asyncio.Queue[v1.ControlMessage] = field(default_factory=asyncio.Queue)
    replaced: asyncio.Event = field(default_factory=asyncio.Event)
    # Commands sent on this stream and not yet answered.
    pending: set[str] = field(default_factory=set)
    # Shard statuses dropped: shards beyond the bound that nobody asked this node to run.
    dropped: int = 0


class AgentService:
    # How often agents read their engines' metrics (RegisterAck.load_interval).
    load_interval: float = 0.25

    def __init__(
        self,
        events: AgentEvents,
        *,
        heartbeat_interval: float,
        command_timeout: float,
        metrics: Metrics | None = None,
        register_timeout: float = 30.0,
    ) -> None:
        self.events = events
        self.heartbeat_interval = heartbeat_interval
        self.command_timeout = command_timeout
        self.register_timeout = register_timeout
        self.metrics = metrics or Metrics()
        # What one node may report (Register's size, labels, shards; see bounds.py).
        self.bounds = Bounds()
        self.sessions: dict[str, Session] = {}
        self._deadlines: dict[str, tuple[str, asyncio.TimerHandle]] = {}
        # The leader's epoch, in every RegisterAck and command (fencing: agents refuse
        # commands older than the newest epoch they saw). Cleared dispatching = a leader
        # that lost its lease: nothing more goes out.
        self.epoch = 0
        self.dispatching = True
        # With HA: the lease is held now (Leadership.valid, true from any thread's view
        # only while the last good renewal is younger than the lease). Asked before a
        # command is queued and again before it is written to a stream.
        self.lease_valid: Callable[[], bool] = _always
        # Engine output an agent sends for a logs request (llmgw_control.logs).
        self.on_logs_chunk: Callable[[Session, v1.LogsChunk], None] = _ignore_chunk

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            "/llmgw.v1.AgentService/Connect": grpclib.const.Handler(
                self.connect,
                grpclib.const.Cardinality.STREAM_STREAM,
                v1.AgentMessage,
                v1.ControlMessage,
            )
        }

    # --- dispatcher -----------------------------------------------------------------

    def post(self, node_id: str, msg: v1.ControlMessage) -> Session | None:
        """Queue a message that is no command (engine logs) on the node's stream, if any."""
        session = self.sessions.get(node_id)
        if session is not None:
            session.outbox.put_nowait(msg)
        return session

    def send(self, node_id: str, command_id: str, msg: v1.ControlMessage) -> bool:
        """Queue ``msg`` on the node's stream; its CommandResult is awaited for a while.

        False when the node has no stream: the reconciler sends again once it has.
        """
        session = self.sessions.get(node_id)
        if session is None or not self.may_dispatch():
            return False
        for command in (
            msg.start_shard,
            msg.stop_shard,
            msg.drain_shard,
            msg.load_adapter,
            msg.unload_adapter,
        ):
            if command is not None:
                command.epoch = self.epoch
        session.outbox.put_nowait(msg)
        session.pending.add(command_id)
        handle = asyncio.get_running_loop().call_later(
            self.command_timeout, self._expire, command_id
        )
        self._deadlines[command_id] = (node_id, handle)
        return True

    def may_dispatch(self) -> bool:
        return self.dispatching and self.lease_valid()

    def _expire(self, command_id: str) -> None:
        entry = self._deadlines.pop(command_id, None)
        if entry is None:
            return
        node_id, _ = entry
        session = self.sessions.get(node_id)
        if session is not None:
            session.pending.discard(command_id)
        self.events.on_command_result(
            node_id,
            command_id,
            False,
            f"no answer within {self.command_timeout:g}s",
            answered=False,
        )

    def _answered(self, node_id: str, result: v1.CommandResult) -> None:
        entry = self._deadlines.pop(result.command_id, None)
        if entry is None:
            log.debug(
                "result for an unknown command", node_id=node_id, command_id=result.command_id
            )
            return
        entry[1].cancel()
        self.events.on_command_result(
            node_id, result.command_id, result.ok, result.error, answered=True
        )

    def _abandon(self, session: Session) -> None:
        """The stream is gone: its unanswered commands failed (the reconciler resends)."""
        for command_id in session.pending:
            entry = self._deadlines.pop(command_id, None)
            if entry is not None:
                entry[1].cancel()
                self.events.on_command_result(
                    session.node_id,
                    command_id,
                    False,
                    "stream closed before an answer",
                    answered=False,
                )
        session.pending.clear()

    # --- the stream -----------------------------------------------------------------

    async def connect(self, stream: Stream) -> None:
        peer = stream.peer.addr() if stream.peer is not None else None
        peer_host = str(peer[0]) if peer else ""
        # With mTLS, only a readable node certificate may open a stream, before it says
        # anything; and then a node may only speak for itself.
        identity = self._identity(stream, peer_host)
        try:
            reading = recv(stream, "agent stream")
            first = await asyncio.wait_for(reading, self.register_timeout)
        except TimeoutError:
            raise GRPCError(
                grpclib.const.Status.DEADLINE_EXCEEDED, "no Register within the deadline"
            ) from None
        register = first.register if first is not None else None
        if register is None or not register.node_id:
            raise GRPCError(
                grpclib.const.Status.INVALID_ARGUMENT,
                "the first message on an agent stream must be a Register with a node_id",
            )
        if identity is not None and identity.name != register.node_id:
            why = f"certificate is for node {identity.name!r}, not node {register.node_id!r}"
            log.warning(
                "agent refused",
                peer=peer_host,
                name=identity.name,
                node_id=register.node_id,
                why=why,
            )
            self.metrics.refusals.labels("agent", "identity").inc()
            raise GRPCError(grpclib.const.Status.PERMISSION_DENIED, why)
        problem = register_problem(register, self.bounds)
        if problem is not None:
            self._refuse_bounds(peer_host, identity, register.node_id, problem)
            raise GRPCError(grpclib.const.Status.RESOURCE_EXHAUSTED, f"Register refused: {problem}")
        session = Session(register.node_id, secrets.token_hex(8), peer_host)
        older = self.sessions.get(session.node_id)
        self.sessions[session.node_id] = session
        if older is not None:
            older.replaced.set()
            self._abandon(older)
            log.info("newer stream replaces older", node_id=session.node_id)
        await stream.send_message(
            v1.ControlMessage(
                register_ack=v1.RegisterAck(
                    session_id=session.session_id,
                    heartbeat_interval=dt.timedelta(seconds=self.heartbeat_interval),
                    load_interval=dt.timedelta(seconds=self.load_interval),
                    epoch=self.epoch,
                )
            )
        )
        if not self.may_dispatch() and deposed_sends_anyway():
            await self._send_anyway(stream, register)
        self.metrics.registrations.inc()
        self.metrics.streams.inc()
        log.info(
            "agent registered",
            node_id=session.node_id,
            peer=peer_host,
            shards=len(register.shards),
            gpus=len(register.inventory.gpus) if register.inventory else 0,
        )
        tasks: set[asyncio.Task[None]] = set()
        malformed: MalformedMessage | MessageTooLarge | None = None
        try:
            self.events.on_register(session, register)
            tasks = {
                asyncio.create_task(self._send_loop(stream, session)),
                asyncio.create_task(self._recv_loop(stream, session)),
                asyncio.create_task(_wait(session.replaced)),
            }
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                failure = None if task.cancelled() else task.exception()
                if isinstance(failure, MalformedMessage | MessageTooLarge):
                    malformed = failure  # already logged, with the peer
                elif failure is not None:
                    log.info("agent stream failed", node_id=session.node_id, error=repr(failure))
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task
            self.metrics.streams.dec()
            if self.sessions.get(session.node_id) is session:
                del self.sessions[session.node_id]
                self._abandon(session)
                self.events.on_disconnect(session)
                log.info("agent disconnected", node_id=session.node_id)
        if malformed is not None:
            raise malformed
        if session.replaced.is_set():
            raise GRPCError(
                grpclib.const.Status.ABORTED, "replaced by a newer stream for this node"
            )

    async def _send_anyway(self, stream: Stream, register: v1.Register) -> None:
        """TEST ONLY (``LLMGW_TEST_DEPOSED_SENDS_ANYWAY``): a StopShard for every shard the
        agent reports, with this instance's old epoch, past every leadership check: what a
        deposed leader that ignored its lost lease would do. The agents must refuse it."""
        for shard in register.shards:
            command_id = f"deposed-{secrets.token_hex(4)}"
            log.warning(
                "test hook: a deposed instance sends StopShard anyway",
                node_id=register.node_id,
                shard_id=shard.shard_id,
                epoch=self.epoch,
                command_id=command_id,
            )
            stop = v1.StopShard(
                command_id=command_id,
                shard_id=shard.shard_id,
                grace=dt.timedelta(seconds=1),
                epoch=self.epoch,
            )
            await stream.send_message(v1.ControlMessage(stop_shard=stop))

    async def _send_loop(self, stream: Stream, session: Session) -> None:
        # The only writer of this stream: concurrent send_message calls could interleave.
        while True:
            msg = await session.outbox.get()
            if not self.may_dispatch() and _is_command(msg):
                # Queued while leading, the lease gone since: not sent (it expires).
                continue
            await stream.send_message(msg)

    async def _recv_loop(self, stream: Stream, session: Session) -> None:
        events = self.events
        while (msg := await recv(stream, "agent stream")) is not None:
            if msg.heartbeat is not None:
                self._heartbeat(session, msg.heartbeat)
            elif msg.shard_status is not None:
                events.on_shard_status(session, msg.shard_status)
            elif msg.command_result is not None:
                session.pending.discard(msg.command_result.command_id)
                self._answered(session.node_id, msg.command_result)
            elif msg.load_report is not None:
                events.on_load_report(session, msg.load_report)
            elif msg.cache_events is not None:
                events.on_cache_events(session, msg.cache_events)
            elif msg.logs_chunk is not None:
                self.on_logs_chunk(session, msg.logs_chunk)
            elif msg.register is not None:
                log.warning("second Register on one stream ignored", node_id=session.node_id)

    def _identity(self, stream: Stream, peer_host: str) -> PeerIdentity | None:
        """The node's certificate identity; None in plaintext; PERMISSION_DENIED otherwise."""
        cert = stream.peer.cert() if stream.peer is not None else None
        if cert is None:
            return None  # plaintext (--insecure): nobody is authenticated
        try:
            identity = read_identity(cert)
        except UnreadableIdentity as err:
            why = f"unreadable certificate identity: {err}"
            log.warning("agent refused", peer=peer_host, why=why)
            self.metrics.refusals.labels("agent", "identity").inc()
            raise GRPCError(grpclib.const.Status.PERMISSION_DENIED, why) from None
        if identity.role != "node":
            why = f"certificate is for {identity.role} {identity.name!r}, not a node"
            log.warning("agent refused", peer=peer_host, name=identity.name, why=why)
            self.metrics.refusals.labels("agent", "identity").inc()
            raise GRPCError(grpclib.const.Status.PERMISSION_DENIED, why)
        return identity

    def _refuse_bounds(
        self, peer_host: str, identity: PeerIdentity | None, node_id: str, why: str
    ) -> None:
        log.warning(
            "agent refused: too large",
            peer=peer_host,
            name=identity.name if identity else "",
            role=identity.role if identity else "",
            node_id=node_id,
            why=why,
        )
        self.metrics.refusals.labels("agent", "too large").inc()

    def _heartbeat(self, session: Session, msg: v1.Heartbeat) -> None:
        self.metrics.heartbeats.inc()
        if msg.sent_at is not None:
            lag = (dt.datetime.now(dt.UTC) - msg.sent_at).total_seconds()
            self.metrics.heartbeat_lag.observe(max(lag, 0.0))
        self.events.on_heartbeat(session, msg)


async def _wait(event: asyncio.Event) -> None:
    await event.wait()


def _always() -> bool:
    return True


# TEST ONLY: the path of a file; while it exists, an instance that does not lead still
# takes agent streams (LeaderGate) and sends StopShard for their shards right after the
# RegisterAck (tests-integration/test_ha.py: the agents refuse a deposed leader).
DEPOSED_SENDS_ANYWAY = "LLMGW_TEST_DEPOSED_SENDS_ANYWAY"


def deposed_sends_anyway() -> bool:
    armed = os.environ.get(DEPOSED_SENDS_ANYWAY, "")
    return bool(armed) and os.path.exists(armed)


def admitted_while_deposed(handler: Callable[[Any], Awaitable[None]]) -> bool:
    """TEST ONLY (see DEPOSED_SENDS_ANYWAY): the LeaderGate lets agent streams through."""
    return isinstance(getattr(handler, "__self__", None), AgentService) and deposed_sends_anyway()


def _ignore_chunk(session: Session, chunk: v1.LogsChunk) -> None:
    pass


def _is_command(msg: v1.ControlMessage) -> bool:
    return (
        msg.start_shard is not None
        or msg.stop_shard is not None
        or msg.drain_shard is not None
        or msg.load_adapter is not None
        or msg.unload_adapter is not None
    )
