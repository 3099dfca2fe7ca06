"""Slots (issue 28): a replica's place within its model/profile, which a replacement
inherits, so that routers move exactly the leaving replica's prefixes to its successor."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_control.catalog import Catalog, ModelConfig, build_catalog
from llmgw_control.inventory import GpuSlot, Node, ShardReport
from llmgw_control.reconciler import Settings, reconcile
from llmgw_control.records import ControlState, Drain, Start
from llmgw_control.slots import fill_slots, lowest_free, next_slot, slot_name
from llmgw_proto import v1

S = v1.ShardState
SETTINGS = Settings(port_range=(20000, 20999), mgmt_interface="lo", startup_grace=0.0)


def test_examples() -> None:
    assert slot_name("m1", "p", 3) == "m1/p/3"
    assert slot_name("m1", "p", -1) == ""
    assert lowest_free([0, 1, 3]) == 2
    assert fill_slots([-1, 0, -1, 2]) == [1, 0, 3, 2]
    # Scaling up: the lowest free index.
    assert next_slot([0, 2], [], 3) == 1
    assert next_slot([0, 1], [], 3) == 2
    # A rollout: the first old slot no new replica holds yet, in retirement order.
    assert next_slot([], [2, 0, 1], 3) == 2
    assert next_slot([2], [2, 0, 1], 3) == 0
    # An old replica drained before its successor started: its slot is free.
    assert next_slot([], [0, 2], 3) == 1
    # Every old slot has its successor: a surge beyond them takes a free index.
    assert next_slot([0, 1], [1, 0], 2) == 2


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-1, 8), max_size=10))
def test_fill_keeps_assigned_slots_and_gives_the_rest_distinct_free_ones(
    slots: list[int],
) -> None:
    out = fill_slots(slots)
    assert all(o == s for o, s in zip(out, slots, strict=True) if s >= 0)
    given_new = [o for o, s in zip(out, slots, strict=True) if s < 0]
    assert all(o >= 0 for o in out)
    assert len(set(given_new)) == len(given_new)
    assert not set(given_new) & {s for s in slots if s >= 0}


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 7), unique=True, max_size=6),
    st.lists(st.integers(0, 7), unique=True, max_size=6),
    st.integers(0, 6),
    st.integers(1, 6),
)
def test_starts_get_slots_unique_among_new_replicas_predecessors_first(
    new: list[int], old: list[int], wanted: int, starts: int
) -> None:
    """Replicas started one after another: each new replica's slot is one no other new
    replica holds; a free index below the wanted count first; then, while an old
    replica's slot has no successor, the first such in retirement order (a replacement
    gets its predecessor's); only then one held by nobody."""
    slots = list(new)
    for _ in range(starts):
        s = next_slot(slots, old, wanted)
        assert s not in slots
        holes = [i for i in range(wanted) if i not in slots and i not in old]
        waiting = [o for o in old if o not in slots]
        if holes:
            assert s == holes[0]
        elif waiting:
            assert s == waiting[0]
        else:
            assert s not in old
        slots.append(s)


# --- through the reconciler -------------------------------------------------------------


def catalog(**profile: Any) -> Catalog:
    fields = {"engine": "vllm", "gpus_per_node": 1, "replicas": 4, **profile}
    models = msgspec.convert([{"name": "m", "profiles": {"p": fields}}], list[ModelConfig])
    return build_catalog(models, "control.yaml")


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 1), st.integers(1, 2))
def test_a_rolling_update_replaces_each_replica_in_its_slot(unavailable: int, surge: int) -> None:
    """4 replicas roll to a new revision: they start in slots 0-3; every old replica is
    retired only as (or after) a new one takes its slot, each slot is held by at most one
    old and one new replica at a time, and the new fleet holds the same 4 slots."""
    nodes = {
        n: Node(
            n,
            "s1",
            gpus=(GpuSlot(0, "g", 1), GpuSlot(1, "g", 1), GpuSlot(2, "g", 1)),
            interfaces={"lo": [f"10.0.0.{i}"]},
        )
        for i, n in enumerate(["a", "b", "c"])
    }
    ids = (f"m.p.{i:08x}" for i in itertools.count())
    state = ControlState()
    now = 10.0

    def run(cat: Catalog) -> None:
        nonlocal state, now
        now += 1.0
        d = reconcile(cat, nodes, state, now, SETTINGS, lambda m, p: next(ids))
        state = d.state
        for c in d.commands:
            node = nodes[c.node_id]
            if isinstance(c, Start):
                node.shards[c.shard_id] = ShardReport(
                    c.shard_id, c.replica_id, S.READY, model="m", profile="p",
                    gpu_indices=c.gpu_indices, port=c.port,
                )  # fmt: skip
            elif isinstance(c, Drain):
                node.shards[c.shard_id].state = S.STOPPED

    first = catalog()
    for _ in range(4):
        run(first)
    assert sorted(r.slot for r in state.replicas.values()) == [0, 1, 2, 3]
    old_slots = {r.replica_id: r.slot for r in state.replicas.values()}

    rollout = {"max_surge": surge, "max_unavailable": unavailable}
    rolled = catalog(rollout=rollout, engine_args=["--x"])
    rev = rolled.profiles[0].revision
    retired: dict[str, int] = {}
    for _ in range(40):
        run(rolled)
        live = [r for r in state.replicas.values() if not r.draining]
        for kind in (True, False):
            held = [r.slot for r in live if (r.revision == rev) is kind]
            assert len(held) == len(set(held)), held
        for r in state.replicas.values():
            if r.draining and r.replica_id in old_slots and r.replica_id not in retired:
                retired[r.replica_id] = r.slot
                # Without room to be short of one, retired once its successor holds
                # its slot (with max_unavailable 1 it may go first: its slot is then
                # the next new replica's, see the end).
                if not unavailable:
                    assert any(n.slot == r.slot for n in live if n.revision == rev)
    live = [r for r in state.replicas.values() if not r.draining]
    assert all(r.revision == rev for r in live)
    assert sorted(r.slot for r in live) == [0, 1, 2, 3]
    assert retired == old_slots
