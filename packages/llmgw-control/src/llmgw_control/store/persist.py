"""The control plane's records in a store: what they hold, and the batching writer.

Nodes (id, address, labels, hardware, last seen, the shards they last reported),
replicas with their shard plans (node, GPUs, ports, endpoint address), the
published endpoints with their version, and the replicas given up after a node was
lost. Heartbeats and live GPU figures are never written.

Times in the control plane are ``time.monotonic()`` values, which mean nothing to
another process; records hold wall-clock times and are mapped back on load.

:class:`Persister` takes records as they change (``stage``) and writes them in
batches from a task of its own, skipping any record whose bytes did not change, so
a fleet of 10,000 agents costs the event loop one dict update per change.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
from llmgw_proto import v1
from prometheus_client import CollectorRegistry, Counter, Histogram

from llmgw_control.inventory import Node, NodeState, ShardReport
from llmgw_control.placement import GpuSlot
from llmgw_control.records import ControlState, Replica, ShardPlan
from llmgw_control.store.base import Change, NotLeader, Records, Store, StoreError

__all__ = [
    "NODE",
    "PUBLISH",
    "REPLICA",
    "Clock",
    "Persister",
    "Restored",
    "decode_state",
    "encode_node",
    "encode_publish",
    "encode_replaced",
    "encode_replica",
]

log = structlog.get_logger(__name__)

NODE = "node"
REPLICA = "replica"
PUBLISH = "publish"
META = "meta"
# Desired-state overrides (scale, drain) by the operator: key -> JSON, read by whoever acts.
OVERRIDE = "override"

_json = msgspec.json.Encoder()
_decode = msgspec.json.Decoder()


@dataclass(frozen=True)
class Clock:
    """Maps monotonic times to wall-clock seconds and back, at one moment."""

    mono: float
    wall: float

    @classmethod
    def now(cls) -> Clock:
        return cls(time.monotonic(), time.time())

    def at_now(self) -> Clock:
        """The same offset, with ``mono`` moved to now (restored nodes are seen now)."""
        mono = time.monotonic()
        return Clock(mono, self.to_wall(mono))

    def to_wall(self, t: float) -> float:
        return t - self.mono + self.wall

    def to_mono(self, t: float) -> float:
        return t - self.wall + self.mono


def _opt_wall(clock: Clock, t: float | None) -> float | None:
    return None if t is None else clock.to_wall(t)


def encode_node(n: Node, clock: Clock) -> bytes:
    return _json.encode(
        {
            "node_id": n.node_id,
            "agent_version": n.agent_version,
            "hostname": n.hostname,
            "labels": n.labels,
            "gpus": [[g.index, g.name, g.memory_bytes] for g in n.gpus],
            "interfaces": n.interfaces,
            "peer_host": n.peer_host,
            "simulated": n.simulated,
            "cpu_count": n.cpu_count,
            "memory_bytes": n.memory_bytes,
            "last_seen": clock.to_wall(n.last_seen),
            "registered_at": n.registered_at.timestamp() if n.registered_at else None,
            "shards": [
                {
                    "shard_id": s.shard_id,
                    "replica_id": s.replica_id,
                    "state": int(s.state),
                    "model": s.model,
                    "profile": s.profile,
                    "endpoint_url": s.endpoint_url,
                    "gpu_indices": list(s.gpu_indices),
                    "port": s.port,
                    "pid": s.pid,
                    "rank": s.rank,
                    "world_size": s.world_size,
                    # The engine's secret: a restarted leader publishes it again.
                    "api_key": s.api_key,
                }
                for s in n.shards.values()
                if s.running
            ],
        }
    )


def encode_replica(r: Replica, clock: Clock) -> bytes:
    return _json.encode(
        {
            "replica_id": r.replica_id,
            "model": r.model,
            "profile": r.profile,
            "size": r.size,
            "shards": [
                {
                    "shard_id": p.shard_id,
                    "node_id": p.node_id,
                    "rank": p.rank,
                    "gpu_indices": list(p.gpu_indices),
                    "port": p.port,
                    "address": p.address,
                }
                for p in r.shards
            ],
            "rendezvous_port": r.rendezvous_port,
            "leader_address": r.leader_address,
            "kv_port": r.kv_port,
            "attempt": r.attempt,
            "failures": r.failures,
            "retry_at": clock.to_wall(r.retry_at) if r.retry_at else 0.0,
            "last_error": r.last_error,
            "explanation": r.explanation,
            "adopted": r.adopted,
            "created_at": clock.to_wall(r.created_at),
            "ready_since": _opt_wall(clock, r.ready_since),
            "draining": r.draining,
            "drain_deadline": clock.to_wall(r.drain_deadline) if r.drain_deadline else 0.0,
            # The profile revision it runs: a rollout in progress goes on after a restart.
            "revision": r.revision,
            # Its slot: a replacement started after a restart still takes it.
            "slot": r.slot,
        }
    )


def encode_publish(version: int, endpoints: Iterable[tuple[Any, ...]]) -> bytes:
    return _json.encode({"version": version, "endpoints": [list(e) for e in endpoints]})


def encode_replaced(replaced: dict[str, float], clock: Clock) -> bytes:
    return _json.encode({k: clock.to_wall(t) for k, t in sorted(replaced.items())})


@dataclass
class Restored:
    nodes: dict[str, Node] = field(default_factory=dict)
    replicas: dict[str, Replica] = field(default_factory=dict)
    replaced: dict[str, float] = field(default_factory=dict)
    publish_version: int = 0
    # Every other kind (override, rollout, meta, ...), as stored.
    other: Records = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.nodes or self.replicas)


def decode_state(records: Records, clock: Clock, description: str) -> Restored:
    """Records into control-plane objects; every node UNREACHABLE, as if just dropped."""
    out = Restored()
    try:
        for key, raw in records.get(NODE, {}).items():
            out.nodes[key] = _node(_decode.decode(raw), clock)
        for key, raw in records.get(REPLICA, {}).items():
            out.replicas[key] = _replica(_decode.decode(raw), clock)
        replaced = records.get(META, {}).get("replaced")
        if replaced is not None:
            out.replaced = {k: clock.to_mono(float(t)) for k, t in _decode.decode(replaced).items()}
        publish = records.get(PUBLISH, {}).get("current")
        if publish is not None:
            out.publish_version = int(_decode.decode(publish)["version"])
    except (msgspec.DecodeError, KeyError, TypeError, ValueError) as err:
        raise StoreError(f"{description}: a record cannot be read: {err!r}") from None
    out.other = {k: dict(v) for k, v in records.items() if k not in (NODE, REPLICA, PUBLISH)}
    return out


def _node(d: dict[str, Any], clock: Clock) -> Node:
    import datetime as dt

    registered = d.get("registered_at")
    node = Node(
        node_id=d["node_id"],
        # No stream yet: the first Register of this node makes a session.
        session_id="",
        agent_version=d.get("agent_version", ""),
        hostname=d.get("hostname", ""),
        labels=dict(d.get("labels", {})),
        gpus=tuple(GpuSlot(int(i), str(name), int(mem)) for i, name, mem in d.get("gpus", [])),
        interfaces={k: list(v) for k, v in d.get("interfaces", {}).items()},
        peer_host=d.get("peer_host", ""),
        simulated=bool(d.get("simulated", False)),
        cpu_count=int(d.get("cpu_count", 0)),
        memory_bytes=int(d.get("memory_bytes", 0)),
        connected=False,
        # As if its stream had just dropped: LOST only after lost_after from now.
        last_seen=clock.mono,
        registered_at=dt.datetime.fromtimestamp(registered, dt.UTC) if registered else None,
        state=NodeState.UNREACHABLE,
    )
    for s in d.get("shards", []):
        node.shards[s["shard_id"]] = ShardReport(
            shard_id=s["shard_id"],
            replica_id=s["replica_id"],
            state=v1.ShardState(int(s["state"])),
            model=s.get("model", ""),
            profile=s.get("profile", ""),
            endpoint_url=s.get("endpoint_url", ""),
            gpu_indices=tuple(int(i) for i in s.get("gpu_indices", [])),
            port=int(s.get("port", 0)),
            pid=int(s.get("pid", 0)),
            rank=int(s.get("rank", 0)),
            world_size=int(s.get("world_size", 1)),
            updated=clock.mono,
            api_key=str(s.get("api_key", "")),
        )
    return node


def _replica(d: dict[str, Any], clock: Clock) -> Replica:
    ready = d.get("ready_since")
    return Replica(
        replica_id=d["replica_id"],
        model=d["model"],
        profile=d["profile"],
        size=int(d.get("size", 1)),
        shards=[
            ShardPlan(
                p["shard_id"],
                p["node_id"],
                int(p["rank"]),
                tuple(int(i) for i in p["gpu_indices"]),
                int(p["port"]),
                p["address"],
            )
            for p in d.get("shards", [])
        ],
        rendezvous_port=int(d.get("rendezvous_port", 0)),
        leader_address=d.get("leader_address", ""),
        kv_port=int(d.get("kv_port", 0)),
        attempt=int(d.get("attempt", 0)),
        failures=int(d.get("failures", 0)),
        retry_at=clock.to_mono(d["retry_at"]) if d.get("retry_at") else 0.0,
        last_error=d.get("last_error", ""),
        explanation=d.get("explanation", ""),
        adopted=bool(d.get("adopted", False)),
        created_at=clock.to_mono(float(d.get("created_at", clock.wall))),
        ready_since=clock.to_mono(ready) if ready is not None else None,
        draining=bool(d.get("draining", False)),
        drain_deadline=clock.to_mono(d["drain_deadline"]) if d.get("drain_deadline") else 0.0,
        revision=d.get("revision", ""),
        slot=int(d.get("slot", -1)),
    )


def apply_restored(state: ControlState, restored: Restored) -> None:
    state.replicas.update(restored.replicas)
    state.replaced.update(restored.replaced)


class StoreMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.writes = Counter(
            "llmgw_control_store_writes", "Batches written to the state store.", registry=registry
        )
        self.records = Counter(
            "llmgw_control_store_records_written",
            "Records written (or deleted) in the state store.",
            registry=registry,
        )
        self.errors = Counter(
            "llmgw_control_store_errors", "Failed state store writes.", registry=registry
        )
        self.seconds = Histogram(
            "llmgw_control_store_write_seconds",
            "Time of one batch write to the state store.",
            registry=registry,
        )


class Persister:
    """Coalesces record changes and writes them in batches, off the event loop's path."""

    def __init__(
        self,
        store: Store,
        metrics: StoreMetrics | None = None,
        *,
        flush_every: float = 0.1,
        on_not_leader: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.flush_every = flush_every
        self.on_not_leader = on_not_leader
        self._written: dict[tuple[str, str], bytes | None] = {}
        self._pending: dict[tuple[str, str], bytes | None] = {}
        # The batch being written (its values are not in ``_written`` yet).
        self._inflight: dict[tuple[str, str], bytes | None] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.enabled = True
        # Write-ahead bookkeeping: a count of changes staged, the count the store holds
        # (every change up to it written), and up to which count changes were dropped
        # (no longer the leader). One batch in flight at a time.
        self._staged = 0
        self._stored = 0
        self._dropped = 0
        self._lock = asyncio.Lock()

    def seed(self, records: Records) -> None:
        """What the store already holds, so unchanged records are not written again."""
        for kind, items in records.items():
            for key, value in items.items():
                self._written[(kind, key)] = value

    def known(self, kind: str) -> set[str]:
        keys = {k for (kd, k), v in self._written.items() if kd == kind and v is not None}
        for layer in (self._inflight, self._pending):
            for (kd, k), v in layer.items():
                if kd == kind:
                    if v is None:
                        keys.discard(k)
                    else:
                        keys.add(k)
        return keys

    def stage(self, kind: str, key: str, value: bytes | None) -> None:
        if not self.enabled:
            return
        ref = (kind, key)
        if ref in self._pending:
            if self._pending[ref] == value:
                return
        elif ref in self._inflight:
            # Being written now: the same value needs nothing, another one must follow.
            if self._inflight[ref] == value:
                return
        elif self._written.get(ref) == value:
            return
        self._pending[ref] = value
        self._staged += 1
        self._idle.clear()
        self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def run(self) -> None:
        delay = self.flush_every
        while True:
            await self._wake.wait()
            # Let changes pile up into one batch.
            await asyncio.sleep(self.flush_every)
            self._wake.clear()
            try:
                await self._flush_once()
                delay = self.flush_every
            except NotLeader as err:
                log.error("state write refused: no longer the leader", error=str(err))
                self._pending.clear()
                self._dropped = self._staged
                self._idle.set()
                if self.on_not_leader is not None:
                    self.on_not_leader()
            except StoreError as err:
                log.error("state write failed; retrying", error=str(err), in_s=delay)
                self._wake.set()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _flush_once(self) -> None:
        async with self._lock:
            await self._write_pending()

    async def _write_pending(self) -> None:
        upto = self._staged
        if not self._pending:
            self._stored = upto
            self._idle.set()
            return
        batch, self._pending = self._pending, {}
        changes = [Change(k, key, v) for (k, key), v in batch.items()]
        started = time.perf_counter()
        self._inflight = batch
        try:
            await self.store.write(changes)
        except BaseException:
            self._inflight = {}
            if self.metrics is not None:
                self.metrics.errors.inc()
            # Keep what was not written, under anything newer staged meanwhile.
            batch.update(self._pending)
            self._pending = batch
            raise
        if self.metrics is not None:
            self.metrics.writes.inc()
            self.metrics.records.inc(len(changes))
            self.metrics.seconds.observe(time.perf_counter() - started)
        self._inflight = {}
        self._written.update(batch)
        # Changes staged while the batch was written are pending still, and counted
        # past ``upto``; everything up to it is in the store.
        self._stored = max(self._stored, upto)
        if not self._pending:
            self._idle.set()

    async def durable(self, timeout: float) -> bool:
        """Write now what is staged so far and wait until the store holds it.

        The controller calls it between deciding and acting (write-ahead): a command
        goes to an agent only once the records it follows from are stored, so a
        control plane killed at any moment comes back knowing every replica it
        started and every drain it began. False when they could not be written in
        ``timeout`` (a store error, the lead lost); what is unwritten stays pending.
        """
        target = self._staged
        try:
            async with asyncio.timeout(timeout):
                while self._stored < target:
                    if self._dropped >= target:
                        return False  # dropped (the lead lost), never to be written
                    async with self._lock:
                        if self._stored < target:
                            await self._write_pending()
        except (TimeoutError, StoreError):
            return False
        return target == 0 or self._dropped < target

    async def flush(self, timeout: float = 5.0) -> None:
        """Write what is pending now (at shutdown); errors are logged, not raised."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while self._pending:
                    try:
                        await self._flush_once()
                    except StoreError as err:
                        log.error("state not written at shutdown", error=str(err))
                        return
