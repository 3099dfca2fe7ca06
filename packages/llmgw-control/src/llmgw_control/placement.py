"""Where a replica runs: a chain of node filters, a bin-packing rank, and the reasons.

Pure functions over :class:`NodeView` values, no I/O. Like Nomad's feasibility and
rank iterators: each filter removes the nodes that cannot take a shard and records
why; the nodes left are ranked: first by spread (the fewest replicas of the same
profile in the node's spread domain: the node itself, or its value of a ``spread``
label such as ``zone``), then by packing (the fullest node that still fits wins, so
large replicas keep finding whole nodes). When nothing fits, the record becomes a
sentence a person can act on:

    0 of 3 nodes fit: 2 have too few free GPUs (need 4, most free is 2 on gpu-b),
    1 is lost (gpu-c)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field

from llmgw_proto.addr import format_hostport

from llmgw_control.catalog import ProfileSpec
from llmgw_control.inventory import GpuSlot, NodeState

__all__ = [
    "SPREAD_NODE",
    "SPREAD_NONE",
    "Demand",
    "GpuSlot",
    "NodeView",
    "Placement",
    "Placer",
    "ShardSlot",
    "Unplaceable",
    "commit",
    "place",
    "share_ports",
]


@dataclass
class NodeView:
    """What placement needs of a node; ``used_*`` includes everything already there."""

    node_id: str
    state: NodeState
    gpus: tuple[GpuSlot, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    # The node's address on the management interface (else its stream's peer); "" when
    # it has none. Ports belong to an address: views of one address share one
    # ``used_ports`` set (see :func:`share_ports`).
    address: str = ""
    used_gpus: set[int] = field(default_factory=set)
    used_ports: set[int] = field(default_factory=set)
    # Cordoned or draining by an operator (llmgw_control.ops): no new replica here.
    cordoned: bool = False
    _eligible: dict[tuple[str, int], tuple[int, ...]] = field(default_factory=dict, repr=False)

    def matching(self, name: str) -> int:
        return sum(1 for g in self.gpus if fnmatch.fnmatchcase(g.name, name))

    def eligible(self, name: str, min_memory: int) -> tuple[int, ...]:
        """GPU indices that meet the constraint, cached: a node's GPUs do not change."""
        key = (name, min_memory)
        found = self._eligible.get(key)
        if found is None:
            found = tuple(
                g.index
                for g in sorted(self.gpus, key=lambda g: g.index)
                if g.memory_bytes >= min_memory and fnmatch.fnmatchcase(g.name, name)
            )
            self._eligible[key] = found
        return found

    def free_ports(
        self, lo: int, hi: int, count: int, also_taken: Set[int] = frozenset()
    ) -> list[int]:
        ports: list[int] = []
        for port in range(lo, hi + 1):
            if port not in self.used_ports and port not in also_taken:
                ports.append(port)
                if len(ports) == count:
                    break
        return ports


# Profile ``spread`` values: spread over nodes (the default), or do not spread.
SPREAD_NODE = "node"
SPREAD_NONE = "none"


@dataclass(frozen=True)
class Demand:
    """What one replica needs: per-node GPUs and constraints, nodes, shared label."""

    gpus_per_node: int = 1
    nodes: int = 1
    gpu_name: str = "*"
    min_memory_bytes: int = 0
    same_label: str = ""
    # What replicas of one profile spread over: "" packs (no spreading), SPREAD_NODE
    # the nodes themselves, any other text the values of that node label.
    spread: str = ""
    # A disaggregated pool's (label, value): only nodes with that value (llmgw_control.pd_place).
    fabric: tuple[str, str] = ("", "")
    # A disaggregated pool's engine also needs its KV connector's port (on the leader).
    kv_port: bool = False

    @classmethod
    def of(cls, profile: ProfileSpec) -> Demand:
        return cls(
            gpus_per_node=profile.gpus_per_node,
            nodes=profile.nodes,
            gpu_name=profile.gpu_name,
            min_memory_bytes=profile.min_memory_bytes,
            same_label=profile.same_label,
            spread="" if profile.spread == SPREAD_NONE else profile.spread,
            kv_port=bool(profile.role),
        )

    def domain(self, node: NodeView) -> str:
        """The spread domain of ``node``: its id, or its value of the spread label."""
        if self.spread == SPREAD_NODE:
            return node.node_id
        return node.labels.get(self.spread, "")

    @property
    def ports_per_node(self) -> int:
        # A multi-node leader needs a second port for the rendezvous (vLLM --master-port);
        # asking it of every candidate keeps the choice of leader free.
        return (2 if self.nodes > 1 else 1) + (1 if self.kv_port else 0)


@dataclass(frozen=True)
class ShardSlot:
    node_id: str
    rank: int
    gpu_indices: tuple[int, ...]
    port: int
    address: str


@dataclass(frozen=True)
class Placement:
    shards: tuple[ShardSlot, ...]
    # The leader's rendezvous port for multi-node replicas; 0 for one node.
    rendezvous_port: int = 0
    # Why these nodes: how many fit and what the rank preferred.
    reason: str = ""
    # A disaggregated pool's KV connector port on the leader; 0 for none.
    kv_port: int = 0

    @property
    def leader(self) -> ShardSlot:
        return self.shards[0]

    @property
    def leader_address(self) -> str:
        if not self.rendezvous_port:
            return ""
        return format_hostport(self.leader.address, self.rendezvous_port)


@dataclass(frozen=True)
class Unplaceable:
    explanation: str
    total: int
    fit: int
    # How many nodes each filter removed, by filter name, in chain order.
    removed: Mapping[str, int]


@dataclass
class _Removal:
    """Nodes one filter removed, and the closest of them to fitting."""

    nodes: list[str] = field(default_factory=list)
    best: int = -1
    best_node: str = ""

    def add(self, node_id: str, value: int) -> None:
        self.nodes.append(node_id)
        if value > self.best or (value == self.best and node_id < self.best_node):
            self.best, self.best_node = value, node_id


# The filter chain, in order; each name is also a key of Unplaceable.removed.
FILTERS = (
    "lost",
    "unreachable",
    "cordoned",
    "address",
    "gpu_name",
    "gpu_memory",
    "free_gpus",
    "label",
    "fabric",
    "ports",
)


def _filter(node: NodeView, demand: Demand, lo: int, hi: int) -> tuple[str, int] | tuple[None, int]:
    """The first filter that removes ``node`` and its near-miss value, or (None, free GPUs)."""
    if node.state != NodeState.READY:
        return ("lost" if node.state == NodeState.LOST else "unreachable"), 0
    if node.cordoned:
        return "cordoned", 0
    if not node.address:
        return "address", 0
    free = 0
    if demand.gpus_per_node:
        need = demand.gpus_per_node
        eligible = node.eligible(demand.gpu_name, demand.min_memory_bytes)
        if len(eligible) < need:
            matching = node.matching(demand.gpu_name)
            if matching < need:
                return "gpu_name", matching
            return "gpu_memory", len(eligible)
        free = sum(1 for i in eligible if i not in node.used_gpus)
        if free < need:
            return "free_gpus", free
    if demand.same_label and demand.same_label not in node.labels:
        return "label", 0
    if demand.fabric[0] and node.labels.get(demand.fabric[0]) != demand.fabric[1]:
        return "fabric", 0
    if len(node.free_ports(lo, hi, demand.ports_per_node)) < demand.ports_per_node:
        return "ports", 0
    return None, free


def _names(nodes: list[str]) -> str:
    shown = sorted(nodes)[:3]
    more = len(nodes) - len(shown)
    return ", ".join(shown) + (f", +{more} more" if more else "")


def _size(n: int) -> str:
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= factor:
            return f"{n / factor:g}{unit}"
    return f"{n}B"


def _phrase(name: str, r: _Removal, demand: Demand, lo: int, hi: int) -> str:
    n = len(r.nodes)
    one = n == 1
    has, is_ = ("has" if one else "have"), ("is" if one else "are")
    need = demand.gpus_per_node
    if name in ("lost", "unreachable", "cordoned"):
        return f"{n} {is_} {name} ({_names(r.nodes)})"
    if name == "address":
        return f"{n} {has} no address on the management interface ({_names(r.nodes)})"
    if name == "gpu_name":
        return (
            f"{n} {has} too few GPUs matching {demand.gpu_name!r} "
            f"(need {need}, most is {r.best} on {r.best_node})"
        )
    if name == "gpu_memory":
        return (
            f"{n} {has} too few GPUs with {_size(demand.min_memory_bytes)} or more "
            f"(need {need}, most is {r.best} on {r.best_node})"
        )
    if name == "free_gpus":
        return f"{n} {has} too few free GPUs (need {need}, most free is {r.best} on {r.best_node})"
    if name == "label":
        return f"{n} {'lacks' if one else 'lack'} label {demand.same_label} ({_names(r.nodes)})"
    if name == "fabric":
        label, value = demand.fabric
        if not value:
            return f"{n} {'lacks' if one else 'lack'} label {label} ({_names(r.nodes)})"
        return f"{n} {is_} not on {label}={value}, the pools' fabric ({_names(r.nodes)})"
    return f"{n} {has} no free port in {lo}-{hi} (need {demand.ports_per_node}; {_names(r.nodes)})"


def place(
    demand: Demand,
    nodes: Iterable[NodeView],
    port_range: tuple[int, int],
    placed: Mapping[str, int] | None = None,
) -> Placement | Unplaceable:
    """Choose nodes, GPUs and ports for one replica, or say why no node can take it.

    ``placed`` counts, per node id, the shards of the profile's other replicas there:
    with ``demand.spread`` the node whose spread domain holds the fewest wins.
    """
    lo, hi = port_range
    removals: dict[str, _Removal] = {}
    refused: dict[str, str] = {}
    fitting: list[tuple[int, NodeView]] = []
    seen: list[NodeView] = []
    for node in nodes:
        seen.append(node)
        reason, value = _filter(node, demand, lo, hi)
        if reason is None:
            # Rank key: free GPUs left after placing here (fewest wins), or for
            # CPU-only shards the most ports in use, so small shards pack together.
            left = value - demand.gpus_per_node if demand.gpus_per_node else -len(node.used_ports)
            fitting.append((left, node))
        else:
            removals.setdefault(reason, _Removal()).add(node.node_id, value)
            refused[node.node_id] = reason
    total = len(seen)
    crowd = domain_counts(demand, seen, placed or {})

    chosen = _choose(demand, fitting, crowd)
    placement = _assign(demand, chosen, lo, hi) if chosen is not None else None
    if chosen is not None and placement is not None:
        return Placement(
            placement.shards,
            placement.rendezvous_port,
            f"{len(fitting)} of {total} nodes fit; {_why(demand, chosen, fitting)}"
            + spread_note(demand, chosen, crowd, seen, refused),
            placement.kv_port,
        )

    removed = {name: len(removals[name].nodes) for name in FILTERS if name in removals}
    # The filter that removed the most nodes comes first: it is what to fix first.
    order = sorted(removed, key=lambda name: (-removed[name], FILTERS.index(name)))
    parts = [_phrase(name, removals[name], demand, lo, hi) for name in order]
    if chosen is not None:
        # Enough nodes fit, but the chosen share one address whose free ports are too
        # few for all of them. Every node is still either fitting or removed by a
        # filter (as in every other refusal; this one counted the chosen as removed
        # by "ports" too, so removed and fit summed to more than the nodes).
        text = (
            f"{len(fitting)} of {total} nodes fit, but the {demand.nodes} chosen share "
            f"{chosen[0].address} and its free ports in {lo}-{hi} are too few for all"
        )
        if parts:
            text += "; " + ", ".join(parts)
        return Unplaceable(text, total, len(fitting), removed)
    if total == 0:
        text = "0 of 0 nodes fit: no agent has registered"
    elif demand.nodes > 1 and fitting:
        text = f"{len(fitting)} of {total} nodes fit, {_group_shortfall(demand, fitting)}"
        if parts:
            text += ": " + ", ".join(parts)
    else:
        text = f"0 of {total} nodes fit: " + ", ".join(parts)
    return Unplaceable(text, total, len(fitting), removed)


def domain_counts(
    demand: Demand, nodes: Iterable[NodeView], placed: Mapping[str, int]
) -> dict[str, int]:
    """Shards of the profile's replicas per spread domain; {} when it does not spread."""
    if not demand.spread or not placed:
        return {}
    counts: dict[str, int] = {}
    for node in nodes:
        count = placed.get(node.node_id, 0)
        if count:
            domain = demand.domain(node)
            counts[domain] = counts.get(domain, 0) + count
    return counts


# Why a node could not take a shard, in a few words (the spread note's list).
_SHORT = {
    "lost": "lost",
    "unreachable": "unreachable",
    "cordoned": "cordoned",
    "address": "no address",
    "gpu_name": "no matching GPUs",
    "gpu_memory": "GPUs too small",
    "free_gpus": "too few free GPUs",
    "label": "lacks the label",
    "fabric": "on another fabric",
    "ports": "no free port",
}


def _where(demand: Demand, domain: str) -> str:
    if demand.spread == SPREAD_NODE:
        return domain
    return f"{demand.spread}={domain or '(none)'}"


def spread_note(
    demand: Demand,
    chosen: Sequence[NodeView],
    crowd: Mapping[str, int],
    nodes: Iterable[NodeView],
    refused: Mapping[str, str],
) -> str:
    """What spreading did for this placement, for ``explain``; "" when nothing to say."""
    if not demand.spread or not crowd:
        return ""
    here = max(chosen, key=lambda n: crowd.get(demand.domain(n), 0))
    domain = demand.domain(here)
    count = crowd.get(domain, 0)
    unit = "node" if demand.spread == SPREAD_NODE else f"{demand.spread} value"
    if count == 0:
        return f"; spread: no other replica of this profile on {_where(demand, domain)}"
    fewer = [
        node for node in nodes if crowd.get(demand.domain(node), 0) < count and node not in chosen
    ]
    if not fewer:
        return f"; spread: every {unit} already has {count} or more of this profile's replicas"
    fewer.sort(key=lambda n: n.node_id)
    why = "; ".join(
        f"{n.node_id}: {_SHORT.get(refused.get(n.node_id, ''), 'fits, but not with the rest of this replica')}"
        for n in fewer[:3]
    )
    more = f"; +{len(fewer) - 3} more" if len(fewer) > 3 else ""
    return (
        f"; spreading was not possible: {_where(demand, domain)} already has {count} of "
        f"this profile's replicas and no {unit} with fewer fits ({why}{more})"
    )


def _why(demand: Demand, chosen: list[NodeView], fitting: list[tuple[int, NodeView]]) -> str:
    names = ", ".join(n.node_id for n in chosen)
    if demand.nodes > 1:
        shared = (
            f" sharing {demand.same_label}={chosen[0].labels[demand.same_label]}"
            if (demand.same_label)
            else ""
        )
        return f"chose {names}{shared} (leader {chosen[0].node_id})"
    if not demand.gpus_per_node:
        return f"chose {names} (CPU-only, packed with the most shards)"
    left = next(left for left, node in fitting if node is chosen[0])
    return f"chose {names}, the fullest that fits ({left} free GPUs left after this)"


def _group_shortfall(demand: Demand, fitting: list[tuple[int, NodeView]]) -> str:
    if not demand.same_label:
        return f"need {demand.nodes}"
    counts: dict[str, int] = {}
    for _, node in fitting:
        value = node.labels[demand.same_label]
        counts[value] = counts.get(value, 0) + 1
    best = min(counts, key=lambda v: (-counts[v], v))
    return f"need {demand.nodes} sharing one {demand.same_label} (most is {counts[best]} in {best})"


def _choose(
    demand: Demand, fitting: list[tuple[int, NodeView]], crowd: Mapping[str, int]
) -> list[NodeView] | None:
    if len(fitting) < demand.nodes:
        return None

    def rank(f: tuple[int, NodeView]) -> tuple[int, int, str]:
        # Spread first (the fewest of this profile in the node's domain), then packing.
        spread = crowd.get(demand.domain(f[1]), 0) if crowd else 0
        return (spread, f[0], f[1].node_id)

    if demand.nodes == 1:
        _, node = min(fitting, key=rank)
        return [node]
    groups: dict[str, list[tuple[int, NodeView]]] = {}
    for entry in fitting:
        value = entry[1].labels[demand.same_label] if demand.same_label else ""
        groups.setdefault(value, []).append(entry)
    best: tuple[int, int, str, list[NodeView]] | None = None
    for value, members in groups.items():
        if len(members) < demand.nodes:
            continue
        members.sort(key=rank)
        picked = members[: demand.nodes]
        spread = sum(rank(f)[0] for f in picked)
        score = sum(left for left, _ in picked)
        if best is None or (spread, score, value) < (best[0], best[1], best[2]):
            best = (spread, score, value, [node for _, node in picked])
    return None if best is None else best[3]


def _assign(demand: Demand, chosen: Sequence[NodeView], lo: int, hi: int) -> Placement | None:
    """GPUs and ports for each chosen node; None when nodes sharing an address run out.

    Ports are unique per address across every shard, those of this placement too:
    two shards on nodes behind one address (agents on one host, one NAT address)
    must not both be handed the first free port before either is committed.
    """
    shards: list[ShardSlot] = []
    rendezvous = kv = 0
    taken: dict[str, set[int]] = {}
    for rank, node in enumerate(chosen):
        eligible = node.eligible(demand.gpu_name, demand.min_memory_bytes)
        gpus = tuple([i for i in eligible if i not in node.used_gpus][: demand.gpus_per_node])
        if not demand.gpus_per_node:
            gpus = ()
        here = taken.setdefault(node.address, set())
        need = demand.ports_per_node if rank == 0 else 1
        ports = node.free_ports(lo, hi, need, here)
        if len(ports) < need:
            return None
        here.update(ports)
        if rank == 0 and demand.nodes > 1:
            rendezvous = ports[1]
        if rank == 0 and demand.kv_port:
            kv = ports[-1]
        shards.append(ShardSlot(node.node_id, rank, gpus, ports[0], node.address))
    return Placement(tuple(shards), rendezvous, kv_port=kv)


def share_ports(views: Iterable[NodeView]) -> None:
    """Give the views of one address one set of used ports (the union of theirs)."""
    spaces: dict[str, set[int]] = {}
    for view in views:
        if view.address:
            space = spaces.setdefault(view.address, set())
            space.update(view.used_ports)
            view.used_ports = space


def commit(placement: Placement, nodes: Mapping[str, NodeView]) -> None:
    """Mark a placement's GPUs and ports as used, so the next replica sees them taken."""
    for shard in placement.shards:
        node = nodes[shard.node_id]
        node.used_gpus.update(shard.gpu_indices)
        node.used_ports.add(shard.port)
    if placement.rendezvous_port:
        nodes[placement.leader.node_id].used_ports.add(placement.rendezvous_port)
    if placement.kv_port:
        nodes[placement.leader.node_id].used_ports.add(placement.kv_port)


class Placer:
    """Places many replicas over one fleet in a row, as a reconcile pass does.

    Chooses the same nodes as :func:`place` (the reference) but keeps, per GPU
    constraint, the nodes bucketed by free GPUs, so a single-node replica finds the
    fullest node that fits without a scan of the whole fleet. Explanations of what
    does not fit always come from :func:`place`; a placement found through the index
    says what the index knows ("N of M nodes have K or more free GPUs"), since
    counting exactly what fits would be the scan the index avoids.
    """

    def __init__(self, nodes: Iterable[NodeView], port_range: tuple[int, int]) -> None:
        self.nodes = {n.node_id: n for n in nodes}
        self.port_range = port_range
        # (gpu name, min memory) -> free GPU count -> ids of READY nodes with an address.
        self._index: dict[tuple[str, int], dict[int, set[str]]] = {}
        # Until something is placed, a demand that did not fit still does not: many
        # unplaceable replicas of one profile cost one explaining scan, not one each.
        self._failed: dict[Demand, Unplaceable] = {}

    def place(
        self, demand: Demand, placed: Mapping[str, int] | None = None
    ) -> Placement | Unplaceable:
        """Place one replica; ``placed``: shards of its profile's replicas per node id."""
        failed = self._failed.get(demand)
        if failed is not None:
            return failed
        placed = placed or {}
        result: Placement | Unplaceable | None = None
        if demand.nodes == 1 and demand.gpus_per_node > 0:
            result = self._fast(demand, placed)
        if result is None:
            result = place(demand, self.nodes.values(), self.port_range, placed)
        if isinstance(result, Placement):
            self.commit(result)
        else:
            self._failed[demand] = result
        return result

    def commit(self, placement: Placement) -> None:
        self._failed.clear()
        commit(placement, self.nodes)
        for shard in placement.shards:
            self._reindex(self.nodes[shard.node_id])

    def _free(self, node: NodeView, key: tuple[str, int]) -> int:
        return sum(1 for i in node.eligible(*key) if i not in node.used_gpus)

    def _buckets(self, key: tuple[str, int]) -> dict[int, set[str]]:
        buckets = self._index.get(key)
        if buckets is None:
            buckets = {}
            for node in self.nodes.values():
                if node.state == NodeState.READY and node.address:
                    buckets.setdefault(self._free(node, key), set()).add(node.node_id)
            self._index[key] = buckets
        return buckets

    def _reindex(self, node: NodeView) -> None:
        for key, buckets in self._index.items():
            for ids in buckets.values():
                ids.discard(node.node_id)
            if node.state == NodeState.READY and node.address:
                buckets.setdefault(self._free(node, key), set()).add(node.node_id)

    def _fast(self, demand: Demand, placed: Mapping[str, int]) -> Placement | None:
        """The fullest fitting node in the emptiest spread domain, found through the index.

        None (the caller scans) when the best node found shares a domain with another
        replica of the profile: only a scan can say why spreading was not possible.
        """
        lo, hi = self.port_range
        key = (demand.gpu_name, demand.min_memory_bytes)
        buckets = self._buckets(key)
        total = len(self.nodes)
        crowd = domain_counts(demand, (self.nodes[n] for n in placed if n in self.nodes), placed)
        enough = sorted(k for k in buckets if k >= demand.gpus_per_node)
        for free in enough:
            for node_id in sorted(buckets[free]):
                node = self.nodes[node_id]
                if crowd and crowd.get(demand.domain(node), 0):
                    continue
                if _filter(node, demand, lo, hi)[0] is not None:
                    continue
                placement = _assign(demand, [node], lo, hi)
                assert placement is not None  # one node, and _filter saw its free port
                # Counting what fits exactly would mean the scan this index avoids.
                roomy = sum(len(buckets[k]) for k in enough)
                left = free - demand.gpus_per_node
                return Placement(
                    placement.shards,
                    0,
                    kv_port=placement.kv_port,
                    reason=f"{roomy} of {total} nodes have {demand.gpus_per_node} or more free GPUs; "
                    f"chose {node.node_id}, the fullest that fits ({left} free GPUs left after this)"
                    + spread_note(demand, [node], crowd, (), {}),
                )
        return None
