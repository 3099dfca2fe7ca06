"""The control plane's own records: replicas with their shard plans, what it remembers
between passes, and the commands it sends.

The reconciler (:mod:`llmgw_control.reconciler`) decides on them; the store
(:mod:`llmgw_control.store.persist`) writes and reads them back; status shows them.
Neither depends on the other: both depend on this module only.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from llmgw_proto import v1

from llmgw_control.catalog import ProfileSpec
from llmgw_control.inventory import Node, NodeState

__all__ = [
    "ENDED",
    "Command",
    "ControlState",
    "Drain",
    "Replica",
    "ShardPlan",
    "Start",
    "Stop",
    "new_replica_id",
    "remember_taken",
    "replica_state",
    "taken_on",
    "unsend",
]


@dataclass
class ShardPlan:
    """One shard of a replica, where control placed (or found) it."""

    shard_id: str
    node_id: str
    rank: int
    gpu_indices: tuple[int, ...]
    port: int
    address: str
    # The node session in which StartShard went out; "" = not sent (yet, or again).
    start_session: str = ""
    drain_session: str = ""
    stop_session: str = ""


@dataclass
class Replica:
    replica_id: str
    model: str
    profile: str
    size: int = 1
    shards: list[ShardPlan] = field(default_factory=list)
    rendezvous_port: int = 0
    leader_address: str = ""
    # A disaggregated pool's KV connector port on the leader (issue 32); 0: none.
    kv_port: int = 0
    # Placement attempts so far; part of shard ids so a retry never reuses one.
    attempt: int = 0
    failures: int = 0
    retry_at: float = 0.0
    last_error: str = ""
    last_output_tail: str = ""
    # Why it is where it is, or why it is nowhere.
    explanation: str = ""
    adopted: bool = False
    created_at: float = 0.0
    ready_since: float | None = None
    draining: bool = False
    drain_deadline: float = 0.0
    # Retired while serving: published leaving until then, drained from then (leaving.py).
    leave_at: float = 0.0
    # The profile revision it was started with; "" = unknown (adopted): taken as current.
    revision: str = ""
    # Its place within its model/profile (slots.py, Endpoint.slot); -1: not assigned yet.
    slot: int = -1

    @property
    def key(self) -> tuple[str, str]:
        return (self.model, self.profile)

    @property
    def placed(self) -> bool:
        return bool(self.shards)

    @property
    def complete(self) -> bool:
        return len(self.shards) == self.size

    def shard_id(self, rank: int) -> str:
        base = f"{self.replica_id}-{rank}"
        return base if self.attempt == 0 else f"{base}.{self.attempt}"


@dataclass
class ControlState:
    replicas: dict[str, Replica] = field(default_factory=dict)
    # Stops sent for shards nobody wants: (node, shard) -> node session.
    orphan_stops: dict[tuple[str, str], str] = field(default_factory=dict)
    # Replicas given up because their node was LOST: never adopt them back.
    replaced: dict[str, float] = field(default_factory=dict)
    # (node, port) -> until when: ports a node refused as held by another program.
    taken_ports: dict[tuple[str, int], float] = field(default_factory=dict)
    started_at: float = 0.0
    passes: int = 0


@dataclass(frozen=True)
class Start:
    node_id: str
    shard_id: str
    replica_id: str
    profile: ProfileSpec
    rank: int
    size: int
    gpu_indices: tuple[int, ...]
    port: int
    leader_address: str
    # A disaggregated pool's KV connector port (StartShard.kv_port); 0: none.
    kv_port: int = 0


@dataclass(frozen=True)
class Stop:
    node_id: str
    shard_id: str
    grace: float


@dataclass(frozen=True)
class Drain:
    node_id: str
    shard_id: str
    # Seconds from now until the agent stops it regardless.
    within: float


Command = Start | Stop | Drain


def new_replica_id(model: str, profile: str) -> str:
    return f"{model}.{profile}.{secrets.token_hex(4)}"


def unsend(state: ControlState, command: Command) -> None:
    """Forget that ``command`` went out (it was never answered), so the next pass resends."""
    if isinstance(command, Stop):
        state.orphan_stops.pop((command.node_id, command.shard_id), None)
    for r in state.replicas.values():
        for plan in r.shards:
            if plan.shard_id == command.shard_id and plan.node_id == command.node_id:
                if isinstance(command, Start):
                    plan.start_session = ""
                elif isinstance(command, Drain):
                    plan.drain_session = ""
                else:
                    plan.stop_session = ""


def replica_state(r: Replica, nodes: Mapping[str, Node], now: float) -> str:
    """One word for status: draining, backoff, unplaced, adopting, unreachable, ready, ..."""
    if r.draining:
        return "draining"
    if not r.placed:
        if r.retry_at > now:
            return "backoff"
        return "unplaced" if r.explanation else "pending"
    if not r.complete:
        return "adopting"
    shard_nodes = [nodes.get(p.node_id) for p in r.shards]
    if any(n is None or n.state != NodeState.READY for n in shard_nodes):
        return "unreachable"
    reports = [
        n.shards.get(p.shard_id) if n else None for n, p in zip(shard_nodes, r.shards, strict=True)
    ]
    if all(x is not None and x.state == v1.ShardState.READY for x in reports):
        return "ready"
    if any(x is not None and x.state in ENDED for x in reports):
        return "failed"
    return "starting"


# A shard that ended without being drained or stopped on purpose is a failure.
ENDED = frozenset({v1.ShardState.FAILED, v1.ShardState.STOPPED})


def remember_taken(
    taken: dict[tuple[str, int], float], node_id: str, ports: Iterable[int], until: float
) -> None:
    """Keep ``ports`` off ``node_id`` until ``until`` (a later refusal extends it)."""
    for port in ports:
        if port:
            taken[(node_id, port)] = max(until, taken.get((node_id, port), until))


def taken_on(taken: Mapping[tuple[str, int], float], now: float) -> dict[str, set[int]]:
    """Node -> the ports it refused as taken that are still remembered at ``now``."""
    out: dict[str, set[int]] = {}
    for (node_id, port), until in taken.items():
        if until > now:
            out.setdefault(node_id, set()).add(port)
    return out
