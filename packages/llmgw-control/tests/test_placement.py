"""Placement: filters, bin-packing rank, explanations; properties with hypothesis."""

from __future__ import annotations

import copy
import fnmatch

from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_control.placement import (
    Demand,
    GpuSlot,
    NodeView,
    Placement,
    Placer,
    Unplaceable,
    commit,
    place,
)

GiB = 2**30
PORTS = (20000, 20003)


def gpus(
    count: int, name: str = "NVIDIA H100 80GB HBM3", memory: int = 80 * GiB
) -> tuple[GpuSlot, ...]:
    return tuple(GpuSlot(i, name, memory) for i in range(count))


def node(node_id: str, count: int = 8, state: str = "READY", **kw: object) -> NodeView:
    return NodeView(node_id, state, gpus(count), address="127.0.0.1", **kw)  # type: ignore[arg-type]


def test_issue_example_explanation() -> None:
    nodes = [
        node("gpu-a", 8, used_gpus={0, 1, 2, 3, 4, 5, 6, 7}),
        node("gpu-b", 8, used_gpus={0, 1, 2, 3, 4, 5}),
        node("gpu-c", 8, state="LOST"),
    ]
    result = place(Demand(gpus_per_node=4), nodes, PORTS)
    assert isinstance(result, Unplaceable)
    assert result.explanation == (
        "0 of 3 nodes fit: 2 have too few free GPUs (need 4, most free is 2 on gpu-b), "
        "1 is lost (gpu-c)"
    )
    assert result.removed == {"lost": 1, "free_gpus": 2}


def test_constraint_explanations() -> None:
    nodes = [
        NodeView("a10", "READY", gpus(2, "NVIDIA A10", 24 * GiB), address="10.0.0.1"),
        NodeView("h100-small", "READY", gpus(2, "NVIDIA H100 PCIe", 40 * GiB), address="10.0.0.2"),
        NodeView("h100", "UNREACHABLE", gpus(2), address="10.0.0.3"),
        NodeView("noaddr", "READY", gpus(2), address=""),
        NodeView(
            "busy", "READY", gpus(2), address="10.0.0.4", used_ports={20000, 20001, 20002, 20003}
        ),
    ]
    result = place(
        Demand(gpus_per_node=2, gpu_name="NVIDIA H100*", min_memory_bytes=80 * GiB), nodes, PORTS
    )
    assert isinstance(result, Unplaceable)
    text = result.explanation
    assert text.startswith("0 of 5 nodes fit: ")
    assert "1 has too few GPUs matching 'NVIDIA H100*' (need 2, most is 0 on a10)" in text
    assert "1 has too few GPUs with 80GiB or more (need 2, most is 0 on h100-small)" in text
    assert "1 is unreachable (h100)" in text
    assert "1 has no address on the management interface (noaddr)" in text
    assert "1 has no free port in 20000-20003 (need 1; busy)" in text


def test_packs_onto_fullest_node_and_assigns_lowest_free() -> None:
    nodes = {
        "empty": node("empty", 8),
        "half": node("half", 8, used_gpus={0, 2, 3, 4}, used_ports={20000}),
    }
    result = place(Demand(gpus_per_node=2), nodes.values(), PORTS)
    assert isinstance(result, Placement)
    (shard,) = result.shards
    assert (shard.node_id, shard.gpu_indices, shard.port) == ("half", (1, 5), 20001)
    assert result.leader_address == ""
    commit(result, nodes)
    assert nodes["half"].used_gpus == {0, 1, 2, 3, 4, 5}
    assert nodes["half"].used_ports == {20000, 20001}


def test_multi_node_shares_label_and_gets_rendezvous_port() -> None:
    label = "fabric.nvlink-domain"
    nodes = [
        node("a1", 8, labels={label: "nvl-a"}),
        node("b1", 8, labels={label: "nvl-b"}),
        node("b2", 8, labels={label: "nvl-b"}),
        node("x", 8),
    ]
    result = place(Demand(gpus_per_node=8, nodes=2, same_label=label), nodes, PORTS)
    assert isinstance(result, Placement)
    assert [s.node_id for s in result.shards] == ["b1", "b2"]
    assert [s.rank for s in result.shards] == [0, 1]
    assert result.rendezvous_port == 20001
    assert result.leader_address == "127.0.0.1:20001"

    result3 = place(Demand(gpus_per_node=8, nodes=3, same_label=label), nodes, PORTS)
    assert isinstance(result3, Unplaceable)
    assert result3.explanation == (
        "3 of 4 nodes fit, need 3 sharing one fabric.nvlink-domain (most is 2 in nvl-b): "
        "1 lacks label fabric.nvlink-domain (x)"
    )


def test_cpu_only_needs_no_gpus_and_no_nodes_is_explained() -> None:
    result = place(Demand(gpus_per_node=0), [NodeView("cpu", "READY", address="::1")], PORTS)
    assert isinstance(result, Placement)
    assert result.shards[0].gpu_indices == ()
    empty = place(Demand(), [], PORTS)
    assert isinstance(empty, Unplaceable)
    assert empty.explanation == "0 of 0 nodes fit: no agent has registered"


# --- properties -----------------------------------------------------------------------

NAMES = ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "NVIDIA L4"]
LABEL = "fabric.nvlink-domain"


@st.composite
def node_views(draw: st.DrawFn, node_id: str) -> NodeView:
    count = draw(st.integers(0, 4))
    slots = tuple(
        GpuSlot(i, draw(st.sampled_from(NAMES)), draw(st.sampled_from([24, 40, 80])) * GiB)
        for i in range(count)
    )
    labels = draw(st.sampled_from([{}, {LABEL: "a"}, {LABEL: "b"}]))
    return NodeView(
        node_id,
        draw(st.sampled_from(["READY", "READY", "READY", "UNREACHABLE", "LOST"])),
        slots,
        labels=labels,
        address=draw(st.sampled_from(["10.0.0.9", "10.0.0.9", ""])),
        used_gpus=set(draw(st.sets(st.integers(0, max(count - 1, 0)), max_size=count))),
        used_ports=set(draw(st.sets(st.integers(*PORTS), max_size=3))),
    )


@st.composite
def fleets(draw: st.DrawFn) -> list[NodeView]:
    n = draw(st.integers(0, 7))
    return [draw(node_views(f"n{i}")) for i in range(n)]


demands = st.builds(
    Demand,
    gpus_per_node=st.integers(0, 3),
    nodes=st.integers(1, 3),
    gpu_name=st.sampled_from(["*", "NVIDIA H100*", "NVIDIA A100*"]),
    min_memory_bytes=st.sampled_from([0, 40 * GiB, 80 * GiB]),
    same_label=st.sampled_from(["", LABEL]),
).filter(
    lambda d: d.gpus_per_node > 0 or (d.nodes == 1 and d.gpu_name == "*" and not d.min_memory_bytes)
)


def can_host(n: NodeView, d: Demand) -> bool:
    """An independent, brute-force statement of what a node must offer."""
    if n.state != "READY" or not n.address:
        return False
    if d.same_label and d.same_label not in n.labels:
        return False
    free_ports = [p for p in range(PORTS[0], PORTS[1] + 1) if p not in n.used_ports]
    if len(free_ports) < (2 if d.nodes > 1 else 1):
        return False
    usable = [
        g
        for g in n.gpus
        if g.index not in n.used_gpus
        and g.memory_bytes >= d.min_memory_bytes
        and fnmatch.fnmatchcase(g.name, d.gpu_name)
    ]
    return len(usable) >= d.gpus_per_node


@settings(max_examples=150, deadline=None)
@given(fleets(), demands)
def test_a_placement_that_exists_is_found(nodes: list[NodeView], demand: Demand) -> None:
    hosts = [n for n in nodes if can_host(n, demand)]
    groups: dict[str, int] = {}
    for n in hosts:
        key = n.labels[demand.same_label] if demand.same_label else ""
        groups[key] = groups.get(key, 0) + 1
    exists = any(count >= demand.nodes for count in groups.values())
    result = place(demand, nodes, PORTS)
    assert isinstance(result, Placement) == exists, result


@settings(max_examples=150, deadline=None)
@given(fleets(), demands)
def test_explanations_account_for_every_node(nodes: list[NodeView], demand: Demand) -> None:
    result = place(demand, nodes, PORTS)
    if isinstance(result, Unplaceable):
        assert result.total == len(nodes)
        assert sum(result.removed.values()) + result.fit == len(nodes)
        assert result.explanation.startswith(f"{result.fit} of {len(nodes)} nodes fit")
        for count in result.removed.values():
            assert f"{count} " in result.explanation


@settings(max_examples=100, deadline=None)
@given(fleets(), st.lists(demands, min_size=1, max_size=8))
def test_no_gpu_or_port_is_given_twice(nodes: list[NodeView], wanted: list[Demand]) -> None:
    by_id = {n.node_id: n for n in nodes}
    taken_gpus = {n.node_id: set(n.used_gpus) for n in nodes}
    taken_ports = {n.node_id: set(n.used_ports) for n in nodes}
    for demand in wanted:
        result = place(demand, nodes, PORTS)
        if not isinstance(result, Placement):
            continue
        assert len({s.node_id for s in result.shards}) == demand.nodes
        if demand.same_label:
            assert len({by_id[s.node_id].labels[demand.same_label] for s in result.shards}) == 1
        for shard in result.shards:
            assert len(shard.gpu_indices) == demand.gpus_per_node
            assert taken_gpus[shard.node_id].isdisjoint(shard.gpu_indices)
            assert shard.port not in taken_ports[shard.node_id]
            assert PORTS[0] <= shard.port <= PORTS[1]
            taken_gpus[shard.node_id].update(shard.gpu_indices)
            taken_ports[shard.node_id].add(shard.port)
        if result.rendezvous_port:
            assert result.rendezvous_port not in taken_ports[result.leader.node_id]
            taken_ports[result.leader.node_id].add(result.rendezvous_port)
        commit(result, by_id)


@settings(max_examples=100, deadline=None)
@given(fleets(), st.lists(demands, min_size=1, max_size=8))
def test_placer_index_chooses_what_place_chooses(
    nodes: list[NodeView], wanted: list[Demand]
) -> None:
    reference = copy.deepcopy(nodes)
    by_id = {n.node_id: n for n in reference}
    placer = Placer(nodes, PORTS)
    for demand in wanted:
        fast = placer.place(demand)
        slow = place(demand, reference, PORTS)
        assert isinstance(fast, Placement) == isinstance(slow, Placement)
        if isinstance(fast, Placement) and isinstance(slow, Placement):
            assert fast.shards == slow.shards
            assert fast.rendezvous_port == slow.rendezvous_port
            commit(slow, by_id)
        else:
            assert fast == slow
