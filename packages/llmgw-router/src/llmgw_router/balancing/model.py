"""cache_aware's capacity and time-to-first-token model (pure): the room each engine's
cache has left, and the predicted time to a request's first token there."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from llmgw_router.balancing.base import L

__all__ = ["cache_room", "ttft_costs"]


def ttft_costs(
    ready: Sequence[L],
    miss: Sequence[int],
    room: Sequence[int | None],
    at: float,
    prior: float,
) -> list[float]:
    """Per candidate, the predicted time to its first token: ``block_time * (pending +
    miss)``, plus ``block_time`` per live block of other prefixes the request's missing
    blocks push out of a full cache (see CacheAware). ``prior``: seconds per prefix block
    for a candidate that has learned no rate."""
    out = []
    for c, m, free in zip(ready, miss, room, strict=True):
        rate = c.block_time
        t = rate if rate > 0 else prior
        cost = t * (c.pending_at(at) + m)
        if free is not None and m > free:
            cost += t * min(m, m - free)
        out.append(cost)
    return out


def cache_room(ready: Sequence[L], footprint: Callable[[L], int]) -> list[int | None]:
    """Per candidate, the blocks its cache has left beside its live prefixes
    (``footprint``); None where its cache size is not known."""
    out: list[int | None] = []
    for c in ready:
        capacity = c.cache_blocks
        out.append(capacity - footprint(c) if capacity > 0 else None)
    return out
