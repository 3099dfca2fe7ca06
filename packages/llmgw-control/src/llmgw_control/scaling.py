"""Autoscaling and scale to zero, pure: how many replicas a profile wants.

No I/O and no clocks of its own: :func:`autoscale` takes the load figures, the counts
and the time, and returns a decision with the words status and ``explain`` show. The
controller (:mod:`llmgw_control.autoscaler`) gathers its inputs and hands the
reconciler the wanted count.

Autoscaling (``replicas: {min, max}``): the metric is the engines' waiting requests per
ready replica, or their mean KV-cache use. Both directions judge the same load on a
different count. For ``waiting`` the load is every request the replicas hold (running
plus waiting) and a replica runs as many at once as the busiest one runs now (a lower
bound of its capacity, exact once any waits); ``n`` replicas would leave
``max(0, load - n * capacity) / n`` waiting each. For ``kv_cache`` the total use
(``mean * ready``) spreads over ``n``. Above the target for ``up_after``: scale to the
fewest replicas that carry the load at or under the target (at least one more than
ready; none more while that many are wanted already). One replica fewer carrying the
load under the target, for ``down_after``: one fewer (removed by drain). The two
rules never contradict each other under a constant load, so it settles without
swinging. With ``min: 0`` a model with neither requests nor demand for ``idle_after``
goes to zero (counted from the later of the last demand and the first pass seeing
nothing run or wait), and a router's demand brings it back to one at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

__all__ = ["LoadSample", "ScaleDecision", "ScaleSpec", "ScaleState", "autoscale"]


@dataclass(frozen=True)
class ScaleSpec:
    min: int
    max: int
    metric: str = "waiting"  # or "kv_cache"
    target: float = 4.0
    up_after: float = 30.0
    down_after: float = 300.0
    idle_after: float = 600.0


@dataclass(frozen=True)
class LoadSample:
    """One ready replica's fresh figures."""

    running: int
    waiting: int
    kv_cache_usage: float


@dataclass(frozen=True)
class ScaleState:
    wanted: int
    over_since: float | None = None
    under_since: float | None = None
    idle_since: float | None = None


@dataclass(frozen=True)
class ScaleDecision:
    wanted: int
    state: ScaleState
    reason: str
    metric: float | None = None


def _metric(spec: ScaleSpec, samples: Sequence[LoadSample], ready: int) -> float:
    if spec.metric == "kv_cache":
        return sum(s.kv_cache_usage for s in samples) / len(samples)
    return sum(s.waiting for s in samples) / max(ready, 1)


@dataclass(frozen=True)
class FleetLoad:
    """The load a profile's ready replicas carry, to judge it on another count.

    ``waiting``: ``load`` requests held (running + waiting), ``capacity`` running at
    once per replica (the busiest one's running count: a lower bound, exact once a
    replica queues). ``kv_cache``: ``load`` is the total use (mean x replicas).
    """

    metric: str
    load: float
    capacity: float

    @classmethod
    def of(cls, spec: ScaleSpec, samples: Sequence[LoadSample], ready: int) -> FleetLoad:
        if spec.metric == "kv_cache":
            mean = sum(s.kv_cache_usage for s in samples) / len(samples)
            return cls(spec.metric, mean * max(ready, 1), 0.0)
        # Replicas without fresh figures are counted as carrying the mean.
        held = sum(s.running + s.waiting for s in samples)
        load = held * max(ready, len(samples)) / len(samples)
        return cls(spec.metric, load, float(max((s.running for s in samples), default=0)))

    def on(self, n: int) -> float:
        """The metric ``n`` replicas would show carrying this load."""
        if n < 1:
            return math.inf
        if self.metric == "kv_cache":
            return self.load / n
        return max(0.0, self.load - n * self.capacity) / n

    def enough(self, target: float) -> int:
        """The fewest replicas that carry the load at or under ``target``."""
        per = target if self.metric == "kv_cache" else self.capacity + target
        if per <= 0:
            return 1
        if not math.isfinite(self.load):
            return 1 << 30
        n = max(1, math.ceil(self.load / per))
        # Float rounding: step to the exact boundary of :meth:`on`.
        while n > 1 and self.on(n - 1) <= target:
            n -= 1
        while self.on(n) > target:
            n += 1
        return n


def autoscale(
    spec: ScaleSpec,
    state: ScaleState,
    ready: int,
    samples: Sequence[LoadSample],
    now: float,
    *,
    demand_at: float | None = None,
) -> ScaleDecision:
    """The replica count wanted now, between ``spec.min`` and ``spec.max``.

    ``samples`` are the fresh figures of ready replicas (stale ones left out);
    ``demand_at`` is when a router last said it holds requests for the model.
    """
    wanted = min(max(state.wanted, spec.min), spec.max)
    st = replace(state, wanted=wanted)
    if wanted == 0:
        # max 0: an operator scaled it to zero (llmgw-control scale M 0): demand waits.
        if (
            spec.max > 0
            and demand_at is not None
            and (st.idle_since is None or demand_at > st.idle_since)
        ):
            new = replace(st, wanted=1, over_since=None, under_since=None, idle_since=None)
            return ScaleDecision(1, new, "demand from a router: starting a replica")
        return ScaleDecision(0, st, "scaled to zero: no requests and no demand")
    busy = sum(s.running + s.waiting for s in samples)
    if spec.min == 0 and samples and len(samples) >= ready:
        if busy == 0:
            # Idle since the first pass seeing nothing run or wait, or since the last
            # demand if later: zero exactly ``idle_after`` after the last of either.
            since = st.idle_since if st.idle_since is not None else now
            if demand_at is not None:
                since = max(since, demand_at)
            st = replace(st, idle_since=since)
            if now - since >= spec.idle_after:
                new = replace(st, wanted=0, over_since=None, under_since=None, idle_since=now)
                return ScaleDecision(
                    0, new, f"idle for {spec.idle_after:g}s: scaling to zero (by drain)"
                )
        else:
            st = replace(st, idle_since=None)
    if not samples:
        return ScaleDecision(wanted, st, "no fresh load figures: keeping the count")
    metric = _metric(spec, samples, ready)
    fleet = FleetLoad.of(spec, samples, ready)
    if metric > spec.target:
        since = st.over_since if st.over_since is not None else now
        st = replace(st, over_since=since, under_since=None)
        needed = max(ready + 1, fleet.enough(spec.target))
        goal = min(needed, spec.max)
        if goal <= wanted:
            # As many as the load needs are wanted already (starting), or max is.
            held = f"max {spec.max} reached" if needed > spec.max else f"{wanted} wanted"
            return ScaleDecision(
                wanted,
                st,
                f"{spec.metric} {metric:.3g} above target {spec.target:g}: {held}",
                metric,
            )
        if now - since >= spec.up_after:
            st = replace(st, wanted=goal, over_since=None)
            return ScaleDecision(
                goal,
                st,
                f"{spec.metric} {metric:.3g} above target {spec.target:g} for "
                f"{spec.up_after:g}s: {wanted} -> {goal}",
                metric,
            )
        return ScaleDecision(
            wanted, st, f"{spec.metric} {metric:.3g} above target {spec.target:g}", metric
        )
    # One replica fewer would carry the whole load (running + waiting), not only what
    # waits now: judged on what the metric would be on ``ready - 1``.
    fewer = ready - 1
    on_fewer = fleet.on(fewer)
    fits_fewer = fewer >= 1 and len(samples) >= ready and on_fewer < spec.target
    if fits_fewer and wanted > max(spec.min, 1):
        since = st.under_since if st.under_since is not None else now
        st = replace(st, under_since=since, over_since=None)
        would = f"{fewer} replicas would show {spec.metric} {on_fewer:.3g}"
        if now - since >= spec.down_after:
            st = replace(st, wanted=wanted - 1, under_since=None)
            return ScaleDecision(
                wanted - 1,
                st,
                f"{spec.metric} {metric:.3g}, {would}, under target {spec.target:g} "
                f"for {spec.down_after:g}s: {wanted} -> {wanted - 1} (by drain)",
                metric,
            )
        return ScaleDecision(
            wanted,
            st,
            f"{spec.metric} {metric:.3g}, {would}, under target {spec.target:g}",
            metric,
        )
    st = replace(st, over_since=None, under_since=None)
    return ScaleDecision(
        wanted, st, f"{spec.metric} {metric:.3g} within target {spec.target:g}", metric
    )
