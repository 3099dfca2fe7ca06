"""The nodes as their agents describe them, and how fresh that description is.

A node is ``READY`` while its stream is open and heartbeats are fresh,
``UNREACHABLE`` when the stream is gone or no heartbeat came within
``unreachable_after``, and ``LOST`` once nothing was heard for ``lost_after``.
Every ``Register`` replaces the whole record: the agent knows best what runs.
"""

from __future__ import annotations

import datetime as dt
import enum
import functools
from dataclasses import dataclass, field

from llmgw_proto import v1
from llmgw_proto.addr import parse_endpoint_url

__all__ = [
    "EngineVersion",
    "GpuSlot",
    "Inventory",
    "Node",
    "NodeState",
    "ShardReport",
    "endpoint_refusal",
    "node_state",
]

# Shard states that hold GPUs and a port on the node.
RUNNING = frozenset(
    {
        v1.ShardState.PENDING,
        v1.ShardState.VALIDATING,
        v1.ShardState.STARTING,
        v1.ShardState.READY,
        v1.ShardState.DRAINING,
    }
)
TERMINAL = frozenset({v1.ShardState.STOPPED, v1.ShardState.FAILED})


class NodeState(enum.StrEnum):
    """The one spelling of a node's state: inventory sets it, placement filters on it."""

    READY = "READY"
    UNREACHABLE = "UNREACHABLE"
    LOST = "LOST"


@dataclass(frozen=True)
class GpuSlot:
    """One GPU of a node, as its agent reported it."""

    index: int
    name: str
    memory_bytes: int


@dataclass(frozen=True)
class EngineVersion:
    """One engine installed on a node (Register.engines)."""

    kind: str
    version: str
    executable: str = ""
    error: str = ""
    # The flags its help lists (EngineInfo.value_flags / switch_flags), for `check`;
    # ``flags_listed`` False: the agent sent none (an older agent, or past the bounds).
    value_flags: frozenset[str] = frozenset()
    switch_flags: frozenset[str] = frozenset()
    flags_listed: bool = False


def node_state(
    connected: bool, last_seen: float, now: float, unreachable_after: float, lost_after: float
) -> NodeState:
    """Pure: the state of a node last heard from at ``last_seen``."""
    silence = now - last_seen
    if silence >= lost_after:
        return NodeState.LOST
    if not connected or silence >= unreachable_after:
        return NodeState.UNREACHABLE
    return NodeState.READY


@dataclass
class ShardReport:
    """One shard as its agent last reported it."""

    shard_id: str
    replica_id: str
    state: v1.ShardState
    model: str = ""
    profile: str = ""
    endpoint_url: str = ""
    gpu_indices: tuple[int, ...] = ()
    port: int = 0
    pid: int = 0
    rank: int = 0
    world_size: int = 1
    reason: str = ""
    output_tail: str = ""
    exit_code: int | None = None
    signal: int | None = None
    updated: float = 0.0
    # The secret the engine's port requires (routers send it); never shown or logged.
    api_key: str = field(default="", repr=False)
    # On a refusal: the ports another program holds on the node (placed around a while).
    ports_taken: tuple[int, ...] = ()
    # The HTTP paths the engine serves, as the agent read them at READY (): not known.
    routes: tuple[str, ...] = ()
    # What the agent said the engine serves as (issue 32): a pool's role and KV port.
    role: str = ""
    kv_port: int = 0

    @property
    def running(self) -> bool:
        return self.state in RUNNING

    @property
    def refused(self) -> str:
        """Why this READY shard's endpoint is not published (its URL cannot be parsed), or "".

        Such a shard counts as failed: its replica fails and is retried with backoff,
        the engine (still running, its GPUs and port still taken) is stopped as an
        orphan, and its URL never reaches a router (issue 24.7).
        """
        if self.state != v1.ShardState.READY or not self.endpoint_url:
            return ""
        return endpoint_refusal(self.endpoint_url)


@functools.lru_cache(maxsize=4096)
def endpoint_refusal(url: str) -> str:
    """Why an endpoint URL is refused ("" when routers can dial it). Pure."""
    try:
        parse_endpoint_url(url)
    except ValueError as err:
        return f"refused to publish: {err}"
    return ""


@dataclass
class Node:
    node_id: str
    session_id: str
    agent_version: str = ""
    hostname: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    gpus: tuple[GpuSlot, ...] = ()
    interfaces: dict[str, list[str]] = field(default_factory=dict)
    peer_host: str = ""
    simulated: bool = False
    cpu_count: int = 0
    memory_bytes: int = 0
    connected: bool = True
    last_seen: float = 0.0
    registered_at: dt.datetime | None = None
    last_heartbeat_at: dt.datetime | None = None
    state: NodeState = NodeState.READY
    shards: dict[str, ShardReport] = field(default_factory=dict)
    # index -> (memory used bytes, utilization percent), from the last heartbeat.
    gpu_usage: dict[int, tuple[int, int]] = field(default_factory=dict)
    engines: tuple[EngineVersion, ...] = ()

    def address(self, mgmt_interface: str) -> str:
        """The endpoint address: the first address of ``mgmt_interface``, else the peer's."""
        if not mgmt_interface:
            return self.peer_host
        addresses = self.interfaces.get(mgmt_interface) or []
        return addresses[0].split("/")[0] if addresses else ""


def _now_utc() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Inventory:
    """Node records keyed by node id; times are ``time.monotonic()`` values passed in."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}

    def register(self, msg: v1.Register, session_id: str, peer_host: str, now: float) -> Node:
        inv = msg.inventory or v1.Inventory()
        host = inv.host or v1.Host()
        node = Node(
            node_id=msg.node_id,
            session_id=session_id,
            agent_version=msg.agent_version,
            hostname=inv.hostname,
            labels=dict(msg.labels),
            gpus=tuple(GpuSlot(g.index, g.name, g.memory_total_bytes) for g in inv.gpus),
            interfaces={i.name: list(i.addresses) for i in inv.interfaces},
            peer_host=peer_host,
            simulated=inv.simulated,
            cpu_count=host.cpu_count,
            memory_bytes=host.memory_total_bytes,
            last_seen=now,
            registered_at=_now_utc(),
            engines=tuple(
                EngineVersion(
                    v1.EngineKind(e.kind).name.lower(),
                    e.version,
                    e.executable,
                    e.error,
                    frozenset(e.value_flags),
                    frozenset(e.switch_flags),
                    e.flags_listed,
                )
                for e in msg.engines
            ),
        )
        for s in msg.shards:
            node.shards[s.shard_id] = ShardReport(
                shard_id=s.shard_id,
                replica_id=s.replica_id,
                state=s.state,
                model=s.model,
                profile=s.profile,
                endpoint_url=s.endpoint_url,
                gpu_indices=tuple(s.gpu_indices),
                port=s.port,
                pid=s.pid,
                rank=s.rank,
                world_size=max(s.world_size, 1),
                updated=now,
                api_key=s.api_key,
                routes=tuple(s.routes),
            )
        self.nodes[node.node_id] = node
        return node

    def _current(self, node_id: str, session_id: str) -> Node | None:
        # Messages from a replaced stream must not touch the newer record.
        node = self.nodes.get(node_id)
        return node if node is not None and node.session_id == session_id else None

    def heartbeat(self, node_id: str, session_id: str, msg: v1.Heartbeat, now: float) -> None:
        node = self._current(node_id, session_id)
        if node is None:
            return
        node.last_seen = now
        node.last_heartbeat_at = _now_utc()
        node.gpu_usage = {g.index: (g.memory_used_bytes, g.utilization_percent) for g in msg.gpus}

    def shard_status(self, node_id: str, session_id: str, msg: v1.ShardStatus, now: float) -> None:
        node = self._current(node_id, session_id)
        if node is None:
            return
        node.last_seen = now
        report = node.shards.get(msg.shard_id)
        if report is None:
            report = ShardReport(msg.shard_id, msg.replica_id, msg.state)
            node.shards[msg.shard_id] = report
        report.state = msg.state
        report.replica_id = msg.replica_id or report.replica_id
        report.endpoint_url = msg.endpoint_url or report.endpoint_url
        if msg.state == v1.ShardState.READY:
            # READY names the engine's secret (empty: it takes none); later states do not.
            report.api_key = msg.api_key
            report.routes = tuple(msg.routes)
            report.role, report.kv_port = msg.role, msg.kv_port
        report.pid = msg.pid or report.pid
        # A report first made from a status (not from Register) learns here what the
        # shard holds, so its port and GPUs stay taken even after its replica moves.
        report.port = msg.port or report.port
        report.gpu_indices = tuple(msg.gpu_indices) or report.gpu_indices
        report.reason = msg.reason
        report.exit_code = msg.exit_code
        report.signal = msg.signal
        report.output_tail = msg.output_tail or report.output_tail
        report.ports_taken = tuple(msg.ports_taken)
        report.updated = now

    def disconnect(self, node_id: str, session_id: str) -> None:
        node = self._current(node_id, session_id)
        if node is not None:
            node.connected = False

    def refresh(self, now: float, unreachable_after: float, lost_after: float) -> list[Node]:
        """Recompute every node's state; return the nodes whose state changed."""
        changed = []
        for node in self.nodes.values():
            state = node_state(node.connected, node.last_seen, now, unreachable_after, lost_after)
            if state != node.state:
                node.state = state
                changed.append(node)
        return changed

    def prune(self, keep: set[str], now: float, older_than: float = 600.0) -> None:
        """Forget stopped and failed shards nobody refers to, so records stay small."""
        for node in self.nodes.values():
            for shard_id in [
                s.shard_id
                for s in node.shards.values()
                if s.state in TERMINAL and s.shard_id not in keep and now - s.updated > older_than
            ]:
                del node.shards[shard_id]
