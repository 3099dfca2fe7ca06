"""How a key's fleet-wide limits are divided among the routers (pure; after Doorman).

Every router reports, about once a second, what each key would have used at it had it
no share limit (its *demand*). For each limited key the control plane divides

- a rate (rpm, tpm) among the routers that reported recently: :data:`FLOOR` of the
  limit is split evenly (so a router that just started, or whose demand just
  appeared, always gets something); of the rest, when the demands fit each router
  gets its demand and what is left is split evenly (headroom for a burst), and when
  they do not, each gets its part in proportion to its demand. The shares sum to the
  limit, never above it, and a router's share never falls as its demand grows.
  Demand is smoothed over a few seconds (:func:`smooth`), and a router is given at
  most what the others' shares held leave (:func:`bounded`), so the shares held at
  the routers never sum above the limit while they move.
- a concurrency limit the same way, in whole requests (each router at least 1).
- a token budget as *grants*: tokens of what is left of the period that a router may
  hold reserved until its next report. A router's target is its demand-weighted part
  of what is left; it gets at most what the other routers' unexpired grants leave, so
  the grants outstanding never sum above what is left and the fleet cannot overrun it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["FLOOR", "SMOOTHING", "bounded", "grant", "smooth", "split", "split_whole"]

# The part of a limit split evenly among the routers, whatever their demand.
FLOOR = 0.1
# Seconds over which a router's reported demand is smoothed: a report covers a second or
# less, in which a few requests look like a large rate, and shares that follow each
# report's figures swing from router to router.
SMOOTHING = 3.0
# Shares are scaled down by this much so that rounding never sums them above the limit.
_SAFE = 1 - 1e-9


def split(limit: float, demands: Mapping[str, float]) -> dict[str, float]:
    """``limit`` divided among the routers of ``demands`` (router -> demand, >= 0).

    Every router gets more than 0 when ``limit`` > 0; the shares sum to at most
    ``limit``; a router's share grows with its demand.
    """
    n = len(demands)
    if n == 0 or limit <= 0:
        return dict.fromkeys(demands, 0.0)
    wants = {r: d if d > 0 and math.isfinite(d) else 0.0 for r, d in demands.items()}
    total = math.fsum(wants.values())
    even = limit * FLOOR / n
    pool = limit * (1 - FLOOR)
    if total <= pool:
        spare = (pool - total) / n
        shares = {r: even + d + spare for r, d in wants.items()}
    else:
        shares = {r: even + pool * (d / total) for r, d in wants.items()}
    return {r: s * _SAFE for r, s in shares.items()}


def split_whole(limit: int, demands: Mapping[str, float]) -> dict[str, int]:
    """``limit`` whole units (concurrent requests) divided as :func:`split` divides,
    by largest remainder, each router at least 1. With fewer units than routers each
    still gets 1 (so the sum is the number of routers, above the limit): a share of 0
    would refuse every request at that router."""
    n = len(demands)
    if n == 0 or limit <= 0:
        return dict.fromkeys(demands, 0)
    if limit <= n:
        return dict.fromkeys(demands, 1)
    # One unit each first, then the rest as split() divides it.
    exact = split(float(limit - n), demands)
    whole = {r: 1 + math.floor(x) for r, x in exact.items()}
    left = limit - sum(whole.values())
    by_remainder = sorted(exact, key=lambda r: (exact[r] - math.floor(exact[r]), r), reverse=True)
    for r in by_remainder[: max(left, 0)]:
        whole[r] += 1
    return whole


def grant(
    remaining: int,
    router: str,
    demands: Mapping[str, float],
    others: Mapping[str, int],
) -> int:
    """Tokens of a budget ``router`` may hold reserved until its next report.

    ``remaining``: the budget less what the fleet used this period; ``demands``: the
    recently reporting routers' token demand (``router`` among them); ``others``: the
    unexpired grants other routers hold. Never more than ``remaining`` less ``others``.
    """
    if remaining <= 0:
        return 0
    wants = dict(demands)
    wants.setdefault(router, 0.0)
    target = math.floor(split(float(remaining), wants)[router])
    free = remaining - sum(v for r, v in others.items() if r != router)
    return max(0, min(target, free))


def smooth(previous: float | None, current: float, elapsed: float) -> float:
    """Demand averaged exponentially over :data:`SMOOTHING` seconds (``elapsed`` since
    the previous figure; the first figure is taken as it is)."""
    current = current if current > 0 and math.isfinite(current) else 0.0
    if previous is None:
        return current
    weight = 1 - math.exp(-max(elapsed, 0.0) / SMOOTHING)
    return previous + weight * (current - previous)


def bounded(target: float, limit: float, others: Mapping[str, float]) -> float:
    """A router's new share: its ``target`` (from :func:`split`), but no more than the
    other routers' shares outstanding leave of ``limit``; they move to their own targets
    at their next reports, so the shares held never sum above the limit, even while
    demand moves. A router that just came may get 0 until the others have reported."""
    return max(0.0, min(target, limit - math.fsum(others.values())))
