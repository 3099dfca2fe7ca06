"""Level-triggered reconciliation: compare what the catalog wants with what agents
report, and say which commands close the gap.

:func:`reconcile` is pure: it takes the catalog, the node records, the control
plane's own replica records and the time, and returns new replica records and
the commands to send. It is safe to run at any moment, as often as wanted:
everything it sends is idempotent at the agent, and it remembers per node
session what it already sent so it does not repeat itself. The thin async loop
that runs it lives in :mod:`llmgw_control.controller`.
"""

from __future__ import annotations

import dataclasses
import urllib.parse
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from llmgw_proto import v1
from llmgw_proto.backoff import exponential

from llmgw_control.catalog import Catalog, ProfileSpec
from llmgw_control.inventory import Node, NodeState, ShardReport
from llmgw_control.leaving import leave_times, publishes_leaving
from llmgw_control.ops import Directives
from llmgw_control.pd_place import fabric_demand
from llmgw_control.placement import (
    Demand,
    NodeView,
    Placement,
    Placer,
    share_ports,
)
from llmgw_control.records import (
    ENDED,
    Command,
    ControlState,
    Drain,
    Replica,
    ShardPlan,
    Start,
    Stop,
    new_replica_id,
    remember_taken,
    taken_on,
)
from llmgw_control.rollout import ReplicaView, rollout_step
from llmgw_control.slots import fill_slots, next_slot

__all__ = ["Decision", "Settings", "reconcile"]


@dataclass(frozen=True)
class Settings:
    port_range: tuple[int, int] = (20000, 29999)
    mgmt_interface: str = ""
    base_backoff: float = 5.0
    max_backoff: float = 300.0
    drain_timeout: float = 120.0
    # A serving replica retired is published leaving this long before its drain (leaving.py).
    warm_before_drain: float = 0.0
    stop_grace: float = 30.0
    # No new replicas this long after start: agents first report what they run.
    startup_grace: float = 10.0
    # How long an adopted multi-node replica may wait for its other ranks to report.
    adopt_grace: float = 120.0
    # How long a port a node refused as held by another program stays off that node.
    port_hold: float = 600.0


@dataclass
class Decision:
    state: ControlState
    commands: list[Command]
    # The earliest time at which a pass could decide differently with no new input
    # (a backoff ends, a drain deadline passes, ...); inf when nothing is pending.
    next_at: float = float("inf")
    # (model, profile) -> the rollout in progress: state, reason, progress counts.
    rollouts: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)


def reconcile(
    catalog: Catalog,
    nodes: Mapping[str, Node],
    state: ControlState,
    now: float,
    settings: Settings,
    new_id: Callable[[str, str], str] = new_replica_id,
    wanted: Mapping[tuple[str, str], int] | None = None,
    ops: Directives | None = None,
) -> Decision:
    """One pass: desired vs actual, as new records and the commands to send.

    ``wanted`` overrides a profile's replica count (the autoscaler's decision);
    ``ops`` is what the operator's overrides ask (:func:`llmgw_control.ops.directives`).
    """
    p = _Pass(catalog, nodes, _clone(state), now, settings, new_id, wanted or {})
    p.ops = ops or Directives()
    return p.run()


def _clone(state: ControlState) -> ControlState:
    """A copy the pass may change freely (cheaper than deepcopy on a large fleet)."""
    replicas = {}
    for rid, r in state.replicas.items():
        twin = _shallow(r)
        twin.shards = [_shallow(p) for p in r.shards]
        replicas[rid] = twin
    return ControlState(
        replicas=replicas,
        orphan_stops=dict(state.orphan_stops),
        replaced=dict(state.replaced),
        taken_ports=dict(state.taken_ports),
        started_at=state.started_at,
        passes=state.passes,
    )


T = TypeVar("T")


def _shallow(obj: T) -> T:
    # copy.copy goes through __reduce_ex__; this is several times faster per object.
    twin: T = object.__new__(type(obj))
    twin.__dict__.update(obj.__dict__)
    return twin


class _Pass:
    def __init__(
        self,
        catalog: Catalog,
        nodes: Mapping[str, Node],
        state: ControlState,
        now: float,
        settings: Settings,
        new_id: Callable[[str, str], str],
        wanted: Mapping[tuple[str, str], int],
    ) -> None:
        self.wanted = wanted
        self.rollouts: dict[tuple[str, str], dict[str, Any]] = {}
        self.catalog = catalog
        self.nodes = nodes
        self.state = state
        self.now = now
        self.s = settings
        self.new_id = new_id
        self.commands: list[Command] = []
        self.ops = Directives()

    def run(self) -> Decision:
        self.state.passes += 1
        self._adopt()
        for replica in list(self.state.replicas.values()):
            self._check(replica)
        self._scale()
        self._place()
        self._stop_orphans()
        self._forget_old()
        return Decision(self.state, self.commands, self._next_at(), self.rollouts)

    def _next_at(self) -> float:
        """Every clock comparison a pass makes, as the moment it would flip."""
        times = [self.state.started_at + self.s.startup_grace]
        for r in self.state.replicas.values():
            if r.draining:
                times.append(r.drain_deadline + self.s.stop_grace)
                if r.leave_at > self.now:
                    times.append(r.leave_at)
            elif not r.placed:
                times.append(r.retry_at)
            elif not r.complete:
                times.append(r.created_at + self.s.adopt_grace)
            elif r.ready_since is not None and (p := self.catalog.get(r.model, r.profile)):
                times.append(r.ready_since + p.min_ready)  # a rollout's next step
        # Strictly later than now: a time already passed was acted on in this pass.
        return min((t for t in times if t > self.now), default=float("inf"))

    # --- adoption ---------------------------------------------------------------------

    def _adopt(self) -> None:
        """Take over shards agents report that control does not know yet."""
        planned = self._planned()
        for node in self._ready_nodes():
            for report in node.shards.values():
                if report.shard_id in planned or report.state not in (
                    v1.ShardState.VALIDATING,
                    v1.ShardState.STARTING,
                    v1.ShardState.READY,
                ):
                    continue
                if report.replica_id in self.state.replaced or report.refused:
                    continue
                profile = self.catalog.get(report.model, report.profile)
                if profile is None or not _matches(report, profile):
                    continue
                replica = self.state.replicas.get(report.replica_id)
                if replica is None:
                    replica = Replica(
                        report.replica_id,
                        report.model,
                        report.profile,
                        size=profile.nodes,
                        adopted=True,
                        created_at=self.now,
                        explanation=f"adopted: reported running by {node.node_id} at registration",
                    )
                    self.state.replicas[replica.replica_id] = replica
                elif not (
                    replica.adopted
                    and replica.model == report.model
                    and replica.profile == report.profile
                    and all(p.rank != report.rank for p in replica.shards)
                ):
                    continue
                replica.shards.append(
                    ShardPlan(
                        report.shard_id,
                        node.node_id,
                        report.rank,
                        report.gpu_indices,
                        report.port,
                        node.address(self.s.mgmt_interface) or _url_host(report.endpoint_url),
                        start_session=node.session_id,
                    )
                )
                replica.shards.sort(key=lambda p: p.rank)
                planned.add(report.shard_id)

    # --- one replica ------------------------------------------------------------------

    def _check(self, r: Replica) -> None:
        if not r.placed:
            if r.draining:
                del self.state.replicas[r.replica_id]
            return
        shard_nodes = [self.nodes.get(p.node_id) for p in r.shards]
        if any(n is None or n.state == NodeState.LOST for n in shard_nodes):
            # The replica is gone with its node; a new one is placed elsewhere, and
            # if the node comes back, what it still runs of this one is stopped.
            self.state.replaced[r.replica_id] = self.now
            del self.state.replicas[r.replica_id]
            return
        reports = [self._report(p) for p in r.shards]
        if r.draining:
            self._drain(r, reports)
            return
        failed = next(
            # A READY shard at a URL no router can dial fails too (issue 24.7).
            (x for x in reports if x is not None and (x.state in ENDED or x.refused)),
            None,
        )
        if failed is None and not r.complete and self.now - r.created_at > self.s.adopt_grace:
            failed = ShardReport(
                "", r.replica_id, v1.ShardState.FAILED, reason="not every rank reported back"
            )
        if failed is not None:
            for plan, report in zip(r.shards, reports, strict=True):
                if report is not None and report.state in ENDED:
                    remember_taken(
                        self.state.taken_ports,
                        plan.node_id,
                        report.ports_taken,
                        self.now + self.s.port_hold,
                    )
            self._fail(r, failed)
            return
        if not r.complete:
            return
        for plan, report, node in zip(r.shards, reports, shard_nodes, strict=True):
            assert node is not None
            if (
                report is None
                and node.state == NodeState.READY
                and plan.start_session != node.session_id
            ):
                plan.start_session = node.session_id
                self.commands.append(self._start(r, plan))
        if all(x is not None and x.state == v1.ShardState.READY for x in reports):
            if r.ready_since is None:
                r.ready_since = self.now
            r.failures = 0
        else:
            r.ready_since = None

    def _fail(self, r: Replica, report: ShardReport) -> None:
        r.failures += 1
        why = (
            report.refused
            or report.reason
            or _exit_text(report)
            or v1.ShardState(report.state).name
        )
        r.last_error = f"{report.shard_id or r.replica_id}: {why}"
        r.last_output_tail = report.output_tail
        delay = exponential(r.failures - 1, self.s.base_backoff, self.s.max_backoff)
        r.retry_at = self.now + delay
        r.explanation = f"failed {r.failures} time(s); retry in {delay:g}s after: {why}"
        # Shards still running become orphans and are stopped below.
        r.shards = []
        r.attempt += 1
        r.ready_since = None
        r.rendezvous_port = 0
        r.leader_address = ""

    def _drain(self, r: Replica, reports: list[ShardReport | None]) -> None:
        """Drain every shard once per node session; stop what outlives the deadline."""
        if publishes_leaving(r.draining, r.leave_at, self.now):
            return  # published leaving: routers warm its heirs first
        done = True
        for plan, report in zip(r.shards, reports, strict=True):
            node = self.nodes[plan.node_id]
            if report is not None and report.state in ENDED:
                continue
            if report is None and node.state == NodeState.READY:
                continue  # the agent does not run it (any more)
            done = False
            if node.state != NodeState.READY:
                continue
            if plan.drain_session != node.session_id:
                plan.drain_session = node.session_id
                self.commands.append(
                    Drain(node.node_id, plan.shard_id, max(r.drain_deadline - self.now, 0.0))
                )
            elif (
                self.now > r.drain_deadline + self.s.stop_grace
                and plan.stop_session != node.session_id
            ):
                plan.stop_session = node.session_id
                self.commands.append(Stop(node.node_id, plan.shard_id, self.s.stop_grace))
        if done:
            del self.state.replicas[r.replica_id]

    # --- desired counts -----------------------------------------------------------------

    def _scale(self) -> None:
        by_profile: dict[tuple[str, str], list[Replica]] = {}
        for r in self.state.replicas.values():
            if not r.draining:
                by_profile.setdefault((r.model, r.profile), []).append(r)
        placing = self.now >= self.state.started_at + self.s.startup_grace
        for key in sorted(set(by_profile) | {p.key for p in self.catalog.profiles}):
            profile = self.catalog.get(*key)
            live = by_profile.get(key, [])
            if profile is None:
                self._trim(live, 0, "draining: its profile left the catalog")
                continue
            wanted = self.wanted.get(key, profile.replicas)
            rev = profile.revision
            ops = self.ops
            for r in [r for r in live if r.replica_id in ops.evict]:
                self._retire(r, ops.evict[r.replica_id])
            live = [r for r in live if r.replica_id not in ops.evict]
            old = [
                r for r in live if (r.revision and r.revision != rev) or r.replica_id in ops.replace
            ]
            new = [r for r in live if r not in old]
            for r, slot in zip(live, fill_slots([r.slot for r in live]), strict=True):
                r.slot = slot
            self._trim(new, wanted, "draining: more replicas than wanted")
            new = [r for r in new if r.replica_id in self.state.replicas]
            count = wanted - len(new)
            # The old replicas' slots in the order the rollout retires them.
            heirs = {r.slot for r in new if r.ready_since is not None}
            old.sort(key=lambda r: (r.ready_since is not None, r.ready_since or 0.0, r.replica_id))
            if old:
                surge, unavailable = profile.max_surge, profile.max_unavailable
                replacing = [r.replica_id for r in old if r.replica_id in ops.replace]
                if replacing:
                    # A drain or a restart: a new replica first, never fewer ready.
                    surge, unavailable = max(surge, 1), 0
                step = rollout_step(
                    wanted,
                    [self._view(r) for r in new],
                    [dataclasses.replace(self._view(r), heir_ready=r.slot in heirs) for r in old],
                    surge,
                    unavailable,
                    now=self.now,
                    min_ready=profile.min_ready,
                )
                count = step.start
                by_id = {r.replica_id: r for r in old}
                drain: tuple[str, ...]
                if profile.model in ops.paused:
                    count, drain, state = 0, (), "paused"
                    reason = "paused by an operator (llmgw-control rollout resume)"
                else:
                    drain, state, reason = step.drain, step.state, step.reason
                for rid in drain:
                    self._retire(
                        by_id[rid], ops.replace.get(rid, f"draining: replaced by revision {rev}")
                    )
                self.rollouts[key] = {
                    "revision": rev,
                    "state": state,
                    "reason": reason,
                    "replacing": sorted(replacing),
                    **step.progress,
                }
            if not placing:
                continue
            slots = [r.slot for r in new]
            for _ in range(count):
                rid = self.new_id(profile.model, profile.name)
                slots.append(next_slot(slots, [r.slot for r in old if not r.draining], wanted))
                self.state.replicas[rid] = Replica(
                    rid,
                    profile.model,
                    profile.name,
                    size=profile.nodes,
                    created_at=self.now,
                    revision=rev,
                    slot=slots[-1],
                )

    def _trim(self, live: list[Replica], wanted: int, why: str) -> None:
        if len(live) <= wanted:
            return
        # Give up the least useful first: unplaced, then not ready, then the newest.
        live.sort(key=self._keep_order)
        for r in live[wanted:]:
            self._retire(r, why)

    def _retire(self, r: Replica, why: str) -> None:
        if not r.placed:
            del self.state.replicas[r.replica_id]
            return
        r.draining = True
        r.leave_at, r.drain_deadline = leave_times(
            self.now, self.s.warm_before_drain, self.s.drain_timeout, r.ready_since is not None
        )
        r.explanation = why
        self._drain(r, [self._report(p) for p in r.shards])

    def _view(self, r: Replica) -> ReplicaView:
        ready = r.ready_since is not None
        return ReplicaView(
            r.replica_id,
            ready=ready,
            placed=r.placed,
            failing=(r.last_error or r.explanation) if r.failures and not ready else "",
            unplaced="" if r.placed else r.explanation,
            ready_since=r.ready_since or 0.0,
        )

    def _keep_order(self, r: Replica) -> tuple[int, float, str]:
        if not r.placed:
            rank = 0
        elif r.ready_since is None:
            rank = 1
        else:
            rank = 2
        return (-rank, r.ready_since if r.ready_since is not None else 0.0, r.replica_id)

    # --- placement ----------------------------------------------------------------------

    def _place(self) -> None:
        waiting = sorted(
            (
                r
                for r in self.state.replicas.values()
                if not r.placed and not r.draining and r.retry_at <= self.now
            ),
            key=lambda r: (r.model, r.profile, r.replica_id),
        )
        if not waiting:
            return
        placer = Placer(self._views().values(), self.s.port_range)
        # Per profile: its live replicas' shards per node, what spreading ranks by.
        spread: dict[tuple[str, str], Counter[str]] = {}
        for other in self.state.replicas.values():
            if other.placed and not other.draining:
                counts = spread.setdefault((other.model, other.profile), Counter())
                counts.update(plan.node_id for plan in other.shards)
        fabrics: dict[tuple[str, str], tuple[tuple[str, str], str]] = {}
        for r in waiting:
            profile = self.catalog.get(r.model, r.profile)
            if profile is None:
                continue
            on = spread.setdefault((r.model, r.profile), Counter())
            demand, fabric = Demand.of(profile), ""
            if profile.role:
                # One choice of fabric per disaggregated profile and pass (pd_place).
                group = (profile.model, profile.pd_group)
                if group not in fabrics:
                    chosen, why = self._pd_demand(profile, placer)
                    fabrics[group] = (chosen.fabric, why)
                pin, fabric = fabrics[group]
                demand = dataclasses.replace(demand, fabric=pin)
            result = placer.place(demand, on)
            if not isinstance(result, Placement):
                r.explanation = result.explanation + (f"; {fabric}" if fabric else "")
                continue
            r.size = profile.nodes
            r.rendezvous_port = result.rendezvous_port
            r.leader_address = result.leader_address
            r.kv_port = result.kv_port
            r.explanation = result.reason + (f"; {fabric}" if fabric else "")
            r.created_at = self.now
            r.revision = profile.revision
            r.shards = [
                ShardPlan(r.shard_id(s.rank), s.node_id, s.rank, s.gpu_indices, s.port, s.address)
                for s in result.shards
            ]
            on.update(s.node_id for s in result.shards)
            for plan in r.shards:
                plan.start_session = self.nodes[plan.node_id].session_id
                self.commands.append(self._start(r, plan))

    def _pd_demand(self, profile: ProfileSpec, placer: Placer) -> tuple[Demand, str]:
        """A disaggregated pool's replica: pinned to the fabric both pools share (pd_place)."""
        running: dict[str, str] = {}
        wanted: Counter[str] = Counter()
        for other in self.state.replicas.values():
            if other.model != profile.model or other.draining:
                continue
            wanted[other.profile] += 1
            node = self.nodes.get(other.shards[0].node_id) if other.shards else None
            if node is not None and profile.fabric_label in node.labels:
                running.setdefault(other.profile, node.labels[profile.fabric_label])
        return fabric_demand(
            profile, self.catalog, running, wanted, placer.nodes.values(), self.s.port_range
        )

    def _views(self) -> dict[str, NodeView]:
        views = {
            n.node_id: NodeView(
                n.node_id,
                n.state,
                n.gpus,
                n.labels,
                n.address(self.s.mgmt_interface),
                cordoned=n.node_id in self.ops.cordoned,
            )
            for n in self.nodes.values()
        }
        # Ports belong to an address, not to a node: agents that share a host (or one
        # NAT address) share its ports, so their views share one set of used ports.
        share_ports(views.values())
        for r in self.state.replicas.values():
            for plan in r.shards:
                view = views.get(plan.node_id)
                if view is not None:
                    view.used_gpus.update(plan.gpu_indices)
                    view.used_ports.add(plan.port)
            if r.rendezvous_port and r.shards:
                view = views.get(r.shards[0].node_id)
                if view is not None:
                    view.used_ports.add(r.rendezvous_port)
            if r.kv_port and r.shards:
                view = views.get(r.shards[0].node_id)
                if view is not None:
                    view.used_ports.add(r.kv_port)
        for n in self.nodes.values():
            view = views[n.node_id]
            for report in n.shards.values():
                if report.running:
                    view.used_gpus.update(report.gpu_indices)
                    if report.port:
                        view.used_ports.add(report.port)
        for node_id, ports in taken_on(self.state.taken_ports, self.now).items():
            view = views.get(node_id)
            if view is not None:
                view.used_ports.update(ports)
        return views

    # --- orphans ----------------------------------------------------------------------

    def _stop_orphans(self) -> None:
        planned = self._planned()
        for node in self._ready_nodes():
            for report in node.shards.values():
                if report.shard_id in planned or not report.running:
                    continue
                if report.state == v1.ShardState.DRAINING:
                    continue  # already on its way out
                key = (node.node_id, report.shard_id)
                if self.state.orphan_stops.get(key) == node.session_id:
                    continue
                self.state.orphan_stops[key] = node.session_id
                self.commands.append(Stop(node.node_id, report.shard_id, self.s.stop_grace))

    def _forget_old(self) -> None:
        horizon = self.now - 24 * 3600
        self.state.replaced = {k: t for k, t in self.state.replaced.items() if t > horizon}
        self.state.taken_ports = {k: t for k, t in self.state.taken_ports.items() if t > self.now}
        live = {
            (n.node_id, s.shard_id)
            for n in self.nodes.values()
            for s in n.shards.values()
            if s.running
        }
        self.state.orphan_stops = {k: v for k, v in self.state.orphan_stops.items() if k in live}

    # --- helpers ----------------------------------------------------------------------

    def _planned(self) -> set[str]:
        return {p.shard_id for r in self.state.replicas.values() for p in r.shards}

    def _ready_nodes(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.state == NodeState.READY]

    def _report(self, plan: ShardPlan) -> ShardReport | None:
        node = self.nodes.get(plan.node_id)
        return None if node is None else node.shards.get(plan.shard_id)

    def _start(self, r: Replica, plan: ShardPlan) -> Start:
        profile = self.catalog.get(r.model, r.profile)
        assert profile is not None
        return Start(
            node_id=plan.node_id,
            shard_id=plan.shard_id,
            replica_id=r.replica_id,
            profile=profile,
            rank=plan.rank,
            size=r.size,
            gpu_indices=plan.gpu_indices,
            port=plan.port,
            leader_address=r.leader_address,
            kv_port=r.kv_port if plan.rank == 0 else 0,
        )


def _matches(report: ShardReport, profile: ProfileSpec) -> bool:
    """Adopt only what the profile would have started: same shape, a valid rank."""
    return (
        report.world_size == profile.nodes
        and 0 <= report.rank < profile.nodes
        and len(report.gpu_indices) == profile.gpus_per_node
    )


def _exit_text(report: ShardReport) -> str:
    if report.signal:
        return f"killed by signal {report.signal}"
    if report.exit_code is not None:
        return f"exited with code {report.exit_code}"
    return ""


def _url_host(url: str) -> str:
    return urllib.parse.urlsplit(url).hostname or ""
