"""A balancer by its configured name."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from llmgw_router.balancing.base import Balancer
from llmgw_router.balancing.cache_aware import CacheAware
from llmgw_router.balancing.simple import LeastOutstanding, RoundRobin, SessionAffinity

if TYPE_CHECKING:
    from llmgw_router.config import CacheAwareConfig

__all__ = ["make_balancer"]


def make_balancer(
    name: str, rng: random.Random | None = None, *, cache_aware: CacheAwareConfig | None = None
) -> Balancer[Any]:
    if name == "cache_aware":
        if cache_aware is None:
            return CacheAware()
        return CacheAware(
            epsilon=cache_aware.epsilon,
            slack=cache_aware.slack,
            window=cache_aware.window,
            affinity_blocks=cache_aware.affinity_blocks,
            index_blocks=cache_aware.index_blocks,
            shared_homes=cache_aware.shared_homes,
            use_slots=cache_aware.use_slots,
            fit_holders=cache_aware.fit_holders,
        )
    if name == "least_outstanding":
        return LeastOutstanding(rng)
    if name == "round_robin":
        return RoundRobin()
    if name == "session_affinity":
        return SessionAffinity(rng)
    raise ValueError(f"unknown balancer {name!r}")
