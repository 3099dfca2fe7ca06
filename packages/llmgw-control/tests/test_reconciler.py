"""The reconciler's decisions, without sockets: desired vs actual -> commands."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_control.catalog import Catalog, ModelConfig, build_catalog
from llmgw_control.inventory import Node, NodeState, ShardReport, node_state
from llmgw_control.leaving import publishes_leaving
from llmgw_control.placement import Demand, GpuSlot, NodeView, Placement, place
from llmgw_control.reconciler import Decision, Settings, reconcile
from llmgw_control.records import (
    ControlState,
    Drain,
    Start,
    Stop,
    remember_taken,
    taken_on,
)
from llmgw_proto import v1

S = v1.ShardState
GiB = 2**30
SETTINGS = Settings(
    port_range=(20000, 20099),
    mgmt_interface="lo",
    base_backoff=1.0,
    max_backoff=8.0,
    drain_timeout=10.0,
    stop_grace=5.0,
    startup_grace=0.0,
    adopt_grace=30.0,
)


def catalog(**profile: Any) -> Catalog:
    fields = {"engine": "vllm", "gpus_per_node": 2, "replicas": 1, **profile}
    models = msgspec.convert([{"name": "m", "profiles": {"p": fields}}], list[ModelConfig])
    return build_catalog(models, "control.yaml")


def make_node(
    node_id: str, gpus: int = 4, session: str = "s1", address: str = "127.0.0.1", **kw: Any
) -> Node:
    return Node(
        node_id,
        session,
        gpus=tuple(GpuSlot(i, "NVIDIA H100", 80 * GiB) for i in range(gpus)),
        interfaces={"lo": [address]},
        **kw,
    )


class World:
    """Nodes, the control state, and a clock; each step runs one reconcile pass."""

    def __init__(self, cat: Catalog, *nodes: Node) -> None:
        self.catalog = cat
        self.nodes = {n.node_id: n for n in nodes}
        self.state = ControlState()
        self.now = 100.0
        self.ids = (f"m.p.{i:08x}" for i in itertools.count())

    def step(self, dt: float = 0.0) -> Decision:
        self.now += dt
        decision = reconcile(
            self.catalog, self.nodes, self.state, self.now, SETTINGS, lambda m, p: next(self.ids)
        )
        self.state = decision.state
        return decision

    def report(self, start: Start, state: v1.ShardState, **kw: Any) -> None:
        self.nodes[start.node_id].shards[start.shard_id] = ShardReport(
            start.shard_id,
            start.replica_id,
            state,
            model=start.profile.model,
            profile=start.profile.name,
            gpu_indices=start.gpu_indices,
            port=start.port,
            rank=start.rank,
            world_size=start.size,
            **kw,
        )


def starts(d: Decision) -> list[Start]:
    return [c for c in d.commands if isinstance(c, Start)]


def test_places_and_starts_once() -> None:
    world = World(
        catalog(replicas=2),
        make_node("a", address="10.0.0.1"),
        make_node("b", gpus=2, address="10.0.0.2"),
    )
    first = starts(world.step())
    # Bin-packing: b (2 GPUs) is filled first, then a.
    assert sorted((s.node_id, s.gpu_indices) for s in first) == [("a", (0, 1)), ("b", (0, 1))]
    assert {s.port for s in first} == {20000}
    assert first[0].shard_id == f"{first[0].replica_id}-0"
    assert world.step(1.0).commands == []
    for s in first:
        world.report(s, S.READY)
    assert world.step(1.0).commands == []
    assert all(r.ready_since is not None for r in world.state.replicas.values())


def test_nodes_sharing_an_address_share_its_ports() -> None:
    # Two agents on one host (a laptop demo, or one NAT address) must not be given
    # the same engine port, not even when one of them still runs an old engine.
    world = World(
        catalog(replicas=2, gpus_per_node=1), make_node("a", gpus=1), make_node("b", gpus=1)
    )
    first = starts(world.step())
    assert sorted(s.port for s in first) == [20000, 20001]
    other = World(
        catalog(replicas=2, gpus_per_node=1),
        make_node("a", gpus=1, address="10.0.0.1"),
        make_node("b", gpus=1, address="10.0.0.2"),
    )
    assert sorted(s.port for s in starts(other.step())) == [20000, 20000]


def test_startup_grace_waits_for_agents() -> None:
    world = World(catalog(), make_node("a"))
    world.state.started_at = world.now
    late = Settings(**{**SETTINGS.__dict__, "startup_grace": 5.0})
    d = reconcile(world.catalog, world.nodes, world.state, world.now + 1, late)
    assert d.commands == []
    assert d.state.replicas == {}
    d = reconcile(world.catalog, world.nodes, world.state, world.now + 6, late)
    assert len(starts(d)) == 1


def test_reported_shards_are_adopted_not_restarted() -> None:
    node = make_node("a")
    node.shards["m.p.old-0"] = ShardReport(
        "m.p.old-0", "m.p.old", S.READY, model="m", profile="p", gpu_indices=(2, 3), port=20000
    )
    world = World(catalog(replicas=2), node)
    d = world.step()
    (start,) = starts(d)
    assert not any(isinstance(c, Stop) for c in d.commands)
    assert start.replica_id != "m.p.old"
    # The new replica does not take the adopted shard's GPUs or port.
    assert (start.gpu_indices, start.port) == ((0, 1), 20001)
    adopted = world.state.replicas["m.p.old"]
    assert adopted.adopted
    assert adopted.ready_since is not None
    assert world.step(1).commands == []


def test_unwanted_shards_are_stopped_once_per_session() -> None:
    node = make_node("a")
    node.shards["x-0"] = ShardReport(
        "x-0", "x", S.READY, model="gone", profile="p", gpu_indices=(0, 1), port=20000
    )
    world = World(catalog(replicas=0), node)
    assert world.step().commands == [Stop("a", "x-0", 5.0)]
    assert world.step(1).commands == []
    node.session_id = "s2"  # reconnected: the stop may have been lost with the stream
    assert world.step(1).commands == [Stop("a", "x-0", 5.0)]


def test_failure_backs_off_exponentially_and_retries_with_new_shard_ids() -> None:
    world = World(catalog(), make_node("a"))
    (start,) = starts(world.step())
    world.report(start, S.FAILED, reason="CUDA out of memory", output_tail="Traceback...")
    assert world.step().commands == []
    replica = world.state.replicas[start.replica_id]
    assert (replica.failures, replica.retry_at, replica.last_output_tail) == (
        1,
        world.now + 1.0,
        "Traceback...",
    )
    assert "CUDA out of memory" in replica.last_error
    assert world.step(0.5).commands == []
    (retry,) = starts(world.step(0.5))
    assert retry.replica_id == start.replica_id
    assert retry.shard_id == f"{start.replica_id}-0.1"
    world.report(retry, S.FAILED, exit_code=1)
    world.step()
    assert world.state.replicas[start.replica_id].retry_at == world.now + 2.0
    assert "exited with code 1" in world.state.replicas[start.replica_id].last_error
    (third,) = starts(world.step(2.0))
    world.report(third, S.READY)
    world.step()
    assert world.state.replicas[start.replica_id].failures == 0


def test_lost_node_replica_is_replaced_and_stopped_when_node_returns() -> None:
    world = World(catalog(), make_node("a"), make_node("b"))
    (start,) = starts(world.step())
    world.report(start, S.READY)
    world.step()
    gone = world.nodes[start.node_id]
    gone.state = NodeState.UNREACHABLE
    assert world.step(1).commands == []
    assert start.replica_id in world.state.replicas
    gone.state = NodeState.LOST
    (replacement,) = starts(world.step(1))
    assert replacement.node_id != start.node_id
    assert replacement.replica_id != start.replica_id
    # The node comes back (new session) still running the old shard: it is stopped.
    gone.state, gone.session_id = NodeState.READY, "s2"
    d = world.step(1)
    assert d.commands == [Stop(start.node_id, start.shard_id, 5.0)]


def test_scale_down_drains_then_stops_after_deadline() -> None:
    world = World(catalog(replicas=2), make_node("a"), make_node("b"))
    first = starts(world.step())
    for s in first:
        world.report(s, S.READY)
    world.step(1)
    world.catalog = catalog(replicas=1)
    d = world.step(1)
    (drain,) = d.commands
    assert isinstance(drain, Drain)
    assert drain.within == 10.0
    assert world.step(1).commands == []
    # Past the deadline and the grace, a shard still running is stopped.
    (stop,) = world.step(15).commands
    assert stop == Stop(drain.node_id, drain.shard_id, 5.0)
    victim = next(s for s in first if s.shard_id == drain.shard_id)
    world.report(victim, S.STOPPED)
    world.step(1)
    assert len(world.state.replicas) == 1
    assert victim.replica_id not in world.state.replicas


def test_multi_node_replica_gets_leader_address() -> None:
    label = "fabric.nvlink-domain"
    world = World(
        catalog(nodes=2, gpus_per_node=4, same_label=label),
        make_node("a", labels={label: "x"}),
        make_node("b", labels={label: "x"}),
        make_node("c", labels={label: "y"}),
    )
    d = starts(world.step())
    assert [(s.node_id, s.rank, s.size) for s in d] == [("a", 0, 2), ("b", 1, 2)]
    assert d[0].leader_address == d[1].leader_address == "127.0.0.1:20001"


def test_unplaceable_replica_carries_explanation() -> None:
    world = World(catalog(gpus_per_node=8), make_node("a"), make_node("b", state=NodeState.LOST))
    assert world.step().commands == []
    (replica,) = world.state.replicas.values()
    assert replica.explanation == (
        "0 of 2 nodes fit: 1 is lost (b), 1 has too few GPUs matching '*' (need 8, most is 4 on a)"
    )


def test_node_state_timings() -> None:
    assert node_state(True, 0.0, 0.5, 1.0, 2.0) == NodeState.READY
    assert node_state(False, 0.0, 0.5, 1.0, 2.0) == NodeState.UNREACHABLE
    assert node_state(True, 0.0, 1.0, 1.0, 2.0) == NodeState.UNREACHABLE
    assert node_state(True, 0.0, 2.0, 1.0, 2.0) == NodeState.LOST


# --- properties -----------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 8), min_size=0, max_size=5),
    st.integers(0, 6),
    st.integers(0, 4),
    st.lists(st.sampled_from([S.READY, S.FAILED, S.STARTING, None]), max_size=12),
)
def test_level_triggered_and_never_double_books(
    node_gpus: list[int], replicas: int, gpus: int, outcomes: list[v1.ShardState | None]
) -> None:
    world = World(
        catalog(replicas=replicas, gpus_per_node=gpus),
        *(make_node(f"n{i}", g) for i, g in enumerate(node_gpus)),
    )
    outcome = iter(outcomes)
    for _ in range(4):
        for s in starts(world.step(0.7)):
            state = next(outcome, S.READY)
            if state is not None:
                world.report(s, state)
        world.step()
        # Nothing changed since the pass before: this pass sends nothing.
        assert world.step().commands == []
        used: set[tuple[str, object]] = set()
        for r in world.state.replicas.values():
            for plan in r.shards:
                for item in (*plan.gpu_indices, f"port {plan.port}"):
                    assert (plan.node_id, item) not in used
                    used.add((plan.node_id, item))
        assert len(world.state.replicas) == replicas


def test_next_at_names_the_next_deadline_and_is_inf_when_settled() -> None:
    world = World(catalog(), make_node("a"))
    (start,) = starts(world.step())
    world.report(start, S.READY)
    assert world.step().next_at == float("inf")
    world.report(start, S.FAILED, reason="boom")
    d = world.step()
    assert d.next_at == world.now + 1.0  # base_backoff: the retry is the next deadline
    assert world.step(0.5).commands == []
    assert len(starts(world.step(0.5))) == 1


def test_a_port_refused_as_taken_is_placed_around_while_remembered() -> None:
    # Issue 24: a port of the range held by another program on the node failed the
    # replica forever, since the retry went to the same port every time.
    world = World(catalog(gpus_per_node=1), make_node("a", gpus=1))
    (start,) = starts(world.step())
    assert start.port == 20000
    for attempt in range(3):
        world.report(
            start, S.FAILED, reason=f"port {start.port} is not free", ports_taken=(start.port,)
        )
        world.step()
        (start,) = starts(world.step(60.0))
        assert start.port == 20001 + attempt
    assert set(world.state.taken_ports) == {("a", 20000), ("a", 20001), ("a", 20002)}
    world.report(start, S.READY)
    world.step()
    # Forgotten after the hold: the port is placed again.
    world.step(SETTINGS.port_hold)
    assert world.state.taken_ports == {}
    other = next(r for r in world.state.replicas.values())
    world.report(start, S.FAILED, exit_code=1)  # a failure that names no port
    world.step()
    (again,) = starts(world.step(60.0))
    assert again.replica_id == other.replica_id
    assert again.port == 20000


@settings(max_examples=200, deadline=None)
@given(
    span=st.integers(min_value=1, max_value=12),
    used=st.sets(st.integers(min_value=0, max_value=11)),
    refusals=st.lists(
        st.tuples(
            st.sampled_from(["a", "b"]),
            st.integers(min_value=0, max_value=11),
            st.floats(min_value=0.0, max_value=1000.0),
        ),
        max_size=20,
    ),
    now=st.floats(min_value=0.0, max_value=1000.0),
)
def test_placement_never_chooses_a_remembered_refused_port(
    span: int, used: set[int], refusals: list[tuple[str, int, float]], now: float
) -> None:
    lo = 20000
    hi = lo + span - 1
    taken: dict[tuple[str, int], float] = {}
    for node_id, offset, refused_at in refusals:
        remember_taken(taken, node_id, [lo + offset], refused_at + 600.0)
    held = taken_on(taken, now)
    views = []
    for node_id, address in (("a", "10.0.0.1"), ("b", "10.0.0.2")):
        view = NodeView(node_id, NodeState.READY, (GpuSlot(0, "H100", GiB),), address=address)
        view.used_ports = {lo + u for u in used} | held.get(node_id, set())
        views.append(view)
    result = place(Demand(gpus_per_node=1), views, (lo, hi))
    free = {v.node_id: [p for p in range(lo, hi + 1) if p not in v.used_ports] for v in views}
    if any(free.values()):
        assert isinstance(result, Placement)
        (shard,) = result.shards
        # Never a port the node refused while it is remembered; always one in range.
        assert shard.port not in held.get(shard.node_id, set())
        assert lo <= shard.port <= hi
        assert shard.port in free[shard.node_id]
    else:
        assert not isinstance(result, Placement)
    # What is remembered ends when its time does, and a later refusal extends it.
    for (node_id, port), until in taken.items():
        assert (port in held.get(node_id, set())) == (until > now)


# --- issue 28: a serving replica retired is published leaving, then drained -----------


def warm_world() -> World:
    world = World(catalog(replicas=2), make_node("a"), make_node("b"))
    first = starts(world.step())
    for s in first:
        world.report(s, S.READY)
    world.step(1)
    return world


def step(world: World, dt: float, warm: float) -> list[object]:
    world.now += dt
    settings = dataclasses.replace(SETTINGS, warm_before_drain=warm)
    d = reconcile(world.catalog, world.nodes, world.state, world.now, settings, lambda m, p: "x")
    world.state = d.state
    world.next_at = d.next_at  # type: ignore[attr-defined]
    return list(d.commands)


def test_scale_down_publishes_leaving_then_drains_after_the_warning() -> None:
    world = warm_world()
    world.catalog = catalog(replicas=2 - 1)
    assert step(world, 1, warm=3.0) == []  # retired, published leaving: no drain yet
    (leaving,) = [r for r in world.state.replicas.values() if r.draining]
    assert leaving.leave_at == world.now + 3.0
    assert leaving.drain_deadline == leaving.leave_at + SETTINGS.drain_timeout
    assert world.next_at == leaving.leave_at  # type: ignore[attr-defined]
    assert publishes_leaving(leaving.draining, leaving.leave_at, world.now)
    assert step(world, 2, warm=3.0) == []
    (drain,) = step(world, 1, warm=3.0)
    assert isinstance(drain, Drain)
    assert drain.within == SETTINGS.drain_timeout


def test_without_warning_the_drain_starts_at_once() -> None:
    world = warm_world()
    world.catalog = catalog(replicas=1)
    (drain,) = step(world, 1, warm=0.0)
    assert isinstance(drain, Drain)
