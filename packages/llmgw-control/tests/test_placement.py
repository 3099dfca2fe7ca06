"""Placement: filters, bin-packing rank, explanations; properties with hypothesis."""

from __future__ import annotations

import copy
import fnmatch

from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_control.inventory import NodeState
from llmgw_control.placement import (
    Demand,
    GpuSlot,
    NodeView,
    Placement,
    Placer,
    Unplaceable,
    commit,
    place,
    share_ports,
)

GiB = 2**30
PORTS = (20000, 20003)


def gpus(
    count: int, name: str = "NVIDIA H100 80GB HBM3", memory: int = 80 * GiB
) -> tuple[GpuSlot, ...]:
    return tuple(GpuSlot(i, name, memory) for i in range(count))


def node(
    node_id: str, count: int = 8, state: NodeState = NodeState.READY, **kw: object
) -> NodeView:
    return NodeView(node_id, state, gpus(count), address="127.0.0.1", **kw)  # type: ignore[arg-type]


def test_issue_example_explanation() -> None:
    nodes = [
        node("gpu-a", 8, used_gpus={0, 1, 2, 3, 4, 5, 6, 7}),
        node("gpu-b", 8, used_gpus={0, 1, 2, 3, 4, 5}),
        node("gpu-c", 8, state=NodeState.LOST),
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
        NodeView("a10", NodeState.READY, gpus(2, "NVIDIA A10", 24 * GiB), address="10.0.0.1"),
        NodeView(
            "h100-small", NodeState.READY, gpus(2, "NVIDIA H100 PCIe", 40 * GiB), address="10.0.0.2"
        ),
        NodeView("h100", NodeState.UNREACHABLE, gpus(2), address="10.0.0.3"),
        NodeView("noaddr", NodeState.READY, gpus(2), address=""),
        NodeView(
            "busy",
            NodeState.READY,
            gpus(2),
            address="10.0.0.4",
            used_ports={20000, 20001, 20002, 20003},
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
    result = place(
        Demand(gpus_per_node=0), [NodeView("cpu", NodeState.READY, address="::1")], PORTS
    )
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
        draw(st.sampled_from([NodeState.READY] * 3 + [NodeState.UNREACHABLE, NodeState.LOST])),
        slots,
        labels=labels,
        address=draw(st.sampled_from(["10.0.0.9", "10.0.0.9", ""])),
        used_gpus=set(draw(st.sets(st.integers(0, max(count - 1, 0)), max_size=count))),
        used_ports=set(draw(st.sets(st.integers(*PORTS), max_size=3))),
    )


@st.composite
def fleets(draw: st.DrawFn) -> list[NodeView]:
    n = draw(st.integers(0, 7))
    views = [draw(node_views(f"n{i}")) for i in range(n)]
    # As the reconciler builds them: nodes behind one address share its ports.
    share_ports(views)
    return views


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
    if n.state != NodeState.READY or not n.address:
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
    if exists and isinstance(result, Unplaceable):
        # Nodes that each have a free port may share one address with too few for all.
        assert demand.nodes > 1, result
        assert " share " in result.explanation, result
        assert result.fit >= demand.nodes
        return
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


def test_a_shared_address_refusal_accounts_for_every_node() -> None:
    """Hypothesis's find: two nodes fit a 2-node replica but share an address whose two
    free ports are too few for both; the third has no GPU. Each node is fitting or
    removed once."""
    nodes = [
        NodeView(f"n{i}", NodeState.READY, gpus(min(i, 1)), address="10.0.0.9") for i in range(3)
    ]
    for n in nodes:
        n.used_ports = {20000, 20001}
    share_ports(nodes)
    result = place(Demand(gpus_per_node=1, nodes=2), nodes, PORTS)
    assert isinstance(result, Unplaceable)
    assert result.fit == 2
    assert list(result.removed.values()) == [1]
    assert result.explanation.startswith("2 of 3 nodes fit, but the 2 chosen share 10.0.0.9")
    assert "1 " in result.explanation.split("; ", 1)[1]


@settings(max_examples=100, deadline=None)
@given(fleets(), st.lists(demands, min_size=1, max_size=8))
def test_no_gpu_or_port_is_given_twice(nodes: list[NodeView], wanted: list[Demand]) -> None:
    by_id = {n.node_id: n for n in nodes}
    taken_gpus = {n.node_id: set(n.used_gpus) for n in nodes}
    # Ports belong to an address: unique across every node behind it.
    taken_ports = {n.address: set(n.used_ports) for n in nodes}
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
            assert shard.port not in taken_ports[shard.address]
            assert PORTS[0] <= shard.port <= PORTS[1]
            taken_gpus[shard.node_id].update(shard.gpu_indices)
            taken_ports[shard.address].add(shard.port)
        if result.rendezvous_port:
            assert result.rendezvous_port not in taken_ports[result.leader.address]
            taken_ports[result.leader.address].add(result.rendezvous_port)
        commit(result, by_id)


@settings(max_examples=150, deadline=None)
@given(
    st.integers(2, 6),
    st.lists(st.sampled_from(["10.0.0.1", "10.0.0.2"]), min_size=6, max_size=6),
    st.lists(st.integers(1, 3), min_size=1, max_size=6),
    st.booleans(),
)
def test_ports_are_unique_per_address_within_one_pass(
    count: int, addresses: list[str], sizes: list[int], indexed: bool
) -> None:
    """Issue 13.1: shards of one multi-node replica on nodes behind one address (agents
    on one host, one NAT address) never get the same port, nor do shards placed later in
    the same pass, whichever path (place, or the indexed Placer) places them."""
    nodes = [
        NodeView(f"n{i}", NodeState.READY, gpus(2), address=addresses[i]) for i in range(count)
    ]
    share_ports(nodes)
    by_id = {n.node_id: n for n in nodes}
    placer = Placer(nodes, (20000, 20009))
    given_out: dict[str, list[int]] = {}
    for size in sizes:
        demand = Demand(gpus_per_node=1, nodes=size)
        if indexed:
            result = placer.place(demand)
        else:
            result = place(demand, nodes, (20000, 20009))
            if isinstance(result, Placement):
                commit(result, by_id)
        if not isinstance(result, Placement):
            continue
        for shard in result.shards:
            given_out.setdefault(shard.address, []).append(shard.port)
        if result.rendezvous_port:
            given_out.setdefault(result.leader.address, []).append(result.rendezvous_port)
    for address, ports in given_out.items():
        assert len(ports) == len(set(ports)), (address, sorted(ports))


def test_two_shards_behind_one_address_get_two_ports() -> None:
    a = NodeView("a", NodeState.READY, gpus(1), address="10.0.0.1")
    b = NodeView("b", NodeState.READY, gpus(1), address="10.0.0.1")
    share_ports([a, b])
    result = place(Demand(gpus_per_node=1, nodes=2), [a, b], (20000, 20009))
    assert isinstance(result, Placement)
    ports = [s.port for s in result.shards] + [result.rendezvous_port]
    assert sorted(ports) == [20000, 20001, 20002]
    # Each node has a free port, but their one address has too few for both shards.
    a.used_ports.update(range(20000, 20008))
    short = place(Demand(gpus_per_node=1, nodes=2), [a, b], (20000, 20009))
    assert isinstance(short, Unplaceable)
    assert "share 10.0.0.1" in short.explanation


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
