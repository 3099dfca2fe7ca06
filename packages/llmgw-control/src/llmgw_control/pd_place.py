"""Placement of disaggregated profiles (issue 32): both pools on one fabric.

A prefill engine hands its KV cache to a decode engine over the fabric, so every
replica of both pools of one profile must run on nodes sharing one value of the
profile's ``fabric_label``. The value is chosen once, when the first replica of either
pool is placed: the one whose nodes take every wanted replica of both pools (trial
placements on a copy of the fleet), the roomiest such if several do; when none takes
them all, the one that takes the most, with an explanation of what each value took.
Once replicas run, their value is kept (replicas placed later join them).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from llmgw_control.catalog import Catalog, ProfileSpec
from llmgw_control.pd_catalog import ROLES, pool_name
from llmgw_control.placement import Demand, NodeView, Placement, Placer

__all__ = ["PoolNeed", "choose_fabric", "fabric_demand"]


@dataclass(frozen=True)
class PoolNeed:
    """One pool: its role, what one replica needs, and how many replicas are wanted."""

    role: str
    demand: Demand
    replicas: int


def _free_gpus(nodes: Iterable[NodeView]) -> int:
    return sum(len(n.gpus) - len(n.used_gpus & {g.index for g in n.gpus}) for n in nodes)


def choose_fabric(
    label: str,
    pools: Sequence[PoolNeed],
    nodes: Iterable[NodeView],
    port_range: tuple[int, int],
) -> tuple[str, str]:
    """``(value, why)``: the value of ``label`` to place both pools on ("" when no node has it).

    Pure: trial placements run on copies; ``nodes`` are not changed.
    """
    views = list(nodes)
    values = sorted({v.labels[label] for v in views if label in v.labels})
    wanted = ", ".join(f"{p.replicas} {p.role}" for p in pools)
    if not values:
        return "", f"no node has label {label} (both pools must share one value of it)"
    # (takes all, replicas taken, free GPUs left) per value; the best is chosen.
    scores: dict[str, tuple[bool, int, int]] = {}
    taken_by: dict[str, dict[str, int]] = {}
    for value in values:
        # One deepcopy of the whole group keeps shared used_ports sets shared.
        group = copy.deepcopy([v for v in views if v.labels.get(label) == value])
        placer = Placer(group, port_range)
        taken = dict.fromkeys((p.role for p in pools), 0)
        for pool in pools:
            on: Counter[str] = Counter()
            for _ in range(pool.replicas):
                result = placer.place(pool.demand, on)
                if not isinstance(result, Placement):
                    break
                on.update(s.node_id for s in result.shards)
                taken[pool.role] += 1
        fits = all(taken[p.role] >= p.replicas for p in pools)
        scores[value] = (fits, sum(taken.values()), _free_gpus(group))
        taken_by[value] = taken
    best = max(values, key=lambda v: (scores[v], [-ord(c) for c in v]))
    if scores[best][0]:
        others = sum(1 for v in values if scores[v][0]) - 1
        return best, (
            f"{label}={best} takes {wanted} replicas"
            + (f" (and the most free GPUs of {others + 1} that do)" if others else "")
        )
    said = "; ".join(
        f"{v} takes " + ", ".join(f"{n} {role}" for role, n in taken_by[v].items()) for v in values
    )
    return best, f"no value of {label} takes {wanted} replicas ({said}); chose {best}"


def fabric_demand(
    profile: ProfileSpec,
    catalog: Catalog,
    running: Mapping[str, str],
    wanted: Mapping[str, int],
    views: Iterable[NodeView],
    port_range: tuple[int, int],
) -> tuple[Demand, str]:
    """The Demand of one pool's replica, pinned to its profile's fabric, and why that one.

    ``running``: pool profile name -> the label value its live replicas already run on;
    ``wanted``: pool profile name -> replicas to place in all.
    """
    demand = Demand.of(profile)
    label = profile.fabric_label
    pools = [
        (role, catalog.get(profile.model, pool_name(profile.pd_group, role))) for role in ROLES
    ]
    for _, spec in pools:
        if spec is not None and spec.name in running:
            value = running[spec.name]
            why = f"{label}={value}, where the profile's replicas run"
            return dataclasses.replace(demand, fabric=(label, value)), why
    # In the reconciler's order (by profile name), so the trial is what the pass does.
    needs = [
        PoolNeed(role, Demand.of(spec), wanted.get(spec.name, spec.replicas))
        for role, spec in sorted(pools, key=lambda p: p[1].name if p[1] else "")
        if spec is not None
    ]
    value, why = choose_fabric(label, needs, views, port_range)
    if not value:
        # No node has the label: pin to a value none has, so place() says so per node.
        return dataclasses.replace(demand, fabric=(label, "")), why
    return dataclasses.replace(demand, fabric=(label, value)), why
