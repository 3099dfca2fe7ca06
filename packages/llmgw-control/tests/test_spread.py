"""Spread (issue 29 point 3): replicas of one profile over nodes, or over a label's values.

Examples of what ``explain`` says, and properties: adding a node never makes spread
worse, spreading never makes a replica unplaceable, and the indexed Placer chooses
what the reference scan chooses.
"""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_control.config import load_control_config
from llmgw_control.inventory import NodeState
from llmgw_control.placement import (
    SPREAD_NODE,
    Demand,
    GpuSlot,
    NodeView,
    Placement,
    Placer,
    commit,
    place,
)
from llmgw_proto.config import ConfigError

PORTS = (20000, 20009)
GiB = 2**30


def view(
    node_id: str, count: int = 2, *, used: int = 0, labels: dict[str, str] | None = None
) -> NodeView:
    return NodeView(
        node_id,
        NodeState.READY,
        tuple(GpuSlot(i, "NVIDIA L4", 24 * GiB) for i in range(count)),
        labels=labels or {},
        address=f"10.0.0.{len(node_id)}",
        used_gpus=set(range(used)),
    )


def run(demand: Demand, nodes: list[NodeView], count: int) -> list[Placement]:
    """Place ``count`` replicas of one profile in a row, as one reconcile pass does."""
    placer = Placer(nodes, PORTS)
    on: Counter[str] = Counter()
    out = []
    for _ in range(count):
        result = placer.place(demand, on)
        if isinstance(result, Placement):
            on.update(s.node_id for s in result.shards)
            out.append(result)
    return out


def test_two_replicas_land_on_two_nodes_by_default_and_pack_within_a_node() -> None:
    # The demo's case: two one-GPU replicas, two nodes of two GPUs. Packing put both on
    # one node; spreading puts one on each, and within a node still takes the fullest.
    nodes = [view("gpu-a"), view("gpu-b"), view("gpu-c", 4, used=2)]
    demand = Demand(gpus_per_node=1, spread=SPREAD_NODE)
    first, second = run(demand, nodes, 2)
    assert first.leader.node_id == "gpu-a"  # fullest that fits (1 left), lowest id
    assert second.leader.node_id == "gpu-b"
    assert "spread: no other replica of this profile on gpu-b" in second.reason
    # Without spreading, the same pair packs onto one node.
    packed = run(Demand(gpus_per_node=1), [view("gpu-a"), view("gpu-b")], 2)
    assert {p.leader.node_id for p in packed} == {"gpu-a"}


def test_explain_says_when_spreading_was_not_possible() -> None:
    nodes = [view("gpu-a"), view("gpu-b", used=2), view("gpu-c", 2, used=2)]
    first, second = run(Demand(gpus_per_node=1, spread=SPREAD_NODE), nodes, 2)
    assert first.leader.node_id == second.leader.node_id == "gpu-a"
    assert second.reason.endswith(
        "; spreading was not possible: gpu-a already has 1 of this profile's replicas "
        "and no node with fewer fits (gpu-b: too few free GPUs; gpu-c: too few free GPUs)"
    )


def test_spread_over_a_label_values() -> None:
    nodes = [
        view("a1", 4, labels={"zone": "z1"}),
        view("a2", 4, labels={"zone": "z1"}),
        view("b1", 4, labels={"zone": "z2"}),
    ]
    placements = run(Demand(gpus_per_node=1, spread="zone"), nodes, 3)
    zones = [
        next(n for n in nodes if n.node_id == p.leader.node_id).labels["zone"] for p in placements
    ]
    assert zones == ["z1", "z2", "z1"]
    # The third: both zones hold one, so it packs onto the fullest in the first.
    assert placements[2].leader.node_id == "a1"
    assert "spread: every zone value already has 1 or more" in placements[2].reason


def test_spread_of_multi_node_replicas_over_a_label() -> None:
    label = "fabric.nvlink-domain"
    nodes = [view(f"{d}{i}", 8, labels={label: d}) for d in "xy" for i in range(2)]
    demand = Demand(gpus_per_node=4, nodes=2, same_label=label, spread=label)
    first, second = run(demand, nodes, 2)
    domains = [
        {next(n for n in nodes if n.node_id == s.node_id).labels[label] for s in p.shards}
        for p in (first, second)
    ]
    assert domains == [{"x"}, {"y"}]


def test_profile_config_spread_default_and_bad_value(tmp_path: Path) -> None:
    def load(**profile: str) -> Demand:
        path = tmp_path / "control.yaml"
        data = {"models": [{"name": "m", "profiles": {"p": {"engine": "vllm", **profile}}}]}
        path.write_text(yaml.safe_dump(data))
        (spec,) = load_control_config(path).catalog.profiles
        return Demand.of(spec)

    assert load().spread == SPREAD_NODE
    assert load(spread="none").spread == ""
    assert load(spread="zone").spread == "zone"
    with pytest.raises(ConfigError) as info:
        load(spread=" ")
    assert "models[0].profiles.p.spread" in str(info.value)
    assert "node, none, or a node label" in str(info.value)


# --- properties -----------------------------------------------------------------------


@st.composite
def fleet(draw: st.DrawFn, prefix: str = "n") -> list[NodeView]:
    count = draw(st.integers(0, 6))
    out = []
    for i in range(count):
        gpus = draw(st.integers(0, 4))
        zone = draw(st.sampled_from(["z1", "z2", "z3", ""]))
        labels = {"zone": zone} if zone else {}
        v = view(f"{prefix}{i}", gpus, used=draw(st.integers(0, gpus)))
        v.labels = labels
        if draw(st.integers(0, 5)) == 0:
            v.state = NodeState.UNREACHABLE
        out.append(v)
    return out


spreads = st.sampled_from([SPREAD_NODE, "zone"])


def domains_used(demand: Demand, nodes: list[NodeView], placements: list[Placement]) -> int:
    by_id = {n.node_id: n for n in nodes}
    return len({demand.domain(by_id[p.leader.node_id]) for p in placements})


@settings(max_examples=200, deadline=None)
@given(fleet(), fleet("extra"), st.integers(1, 3), st.integers(1, 6), spreads)
def test_adding_nodes_never_makes_spread_worse(
    nodes: list[NodeView], extra: list[NodeView], gpus: int, count: int, spread: str
) -> None:
    demand = Demand(gpus_per_node=gpus, spread=spread)
    before = run(demand, copy.deepcopy(nodes), count)
    bigger = copy.deepcopy(nodes) + copy.deepcopy(extra)
    after = run(demand, bigger, count)
    # As many replicas placed, over as many spread domains, or more.
    assert len(after) >= len(before)
    assert domains_used(demand, bigger, after) >= domains_used(demand, nodes, before)


@settings(max_examples=200, deadline=None)
@given(fleet(), st.integers(0, 3), st.integers(1, 6), spreads)
def test_spreading_never_leaves_a_replica_unplaced(
    nodes: list[NodeView], gpus: int, count: int, spread: str
) -> None:
    packed = run(Demand(gpus_per_node=gpus), copy.deepcopy(nodes), count)
    spread_out = run(Demand(gpus_per_node=gpus, spread=spread), copy.deepcopy(nodes), count)
    assert len(spread_out) == len(packed)


@settings(max_examples=200, deadline=None)
@given(fleet(), st.integers(1, 3), st.integers(1, 6), spreads)
def test_placer_with_spread_chooses_what_place_chooses(
    nodes: list[NodeView], gpus: int, count: int, spread: str
) -> None:
    demand = Demand(gpus_per_node=gpus, spread=spread)
    reference = copy.deepcopy(nodes)
    by_id = {n.node_id: n for n in reference}
    on: Counter[str] = Counter()
    placer = Placer(nodes, PORTS)
    for _ in range(count):
        fast = placer.place(demand, on)
        slow = place(demand, reference, PORTS, on)
        assert isinstance(fast, Placement) == isinstance(slow, Placement)
        if not isinstance(slow, Placement) or not isinstance(fast, Placement):
            break
        assert fast.shards == slow.shards
        commit(slow, by_id)
        on.update(s.node_id for s in slow.shards)
