"""cache_aware's capacity and time-to-first-token model (pure): the room each engine's
cache has left, the predicted time to a request's first token there, what the engines
report cached, and the order where load alone decides."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from llmgw_router.balancing.base import L

__all__ = ["cache_room", "engine_matches", "load_order", "ttft_costs"]


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


def engine_matches(
    ready: Sequence[L], cached: Callable[[L], int]
) -> tuple[list[int] | None, list[int]]:
    """Per candidate, its engine's cached blocks of the prompt beyond what every
    reporting engine holds (a shared head, the chat template's, makes no holder); None
    when no engine reports its cache or none holds more than the rest. And the blocks
    each reports cached (0 where it reports none)."""
    reported = [cached(c) for c in ready]
    held = [max(0, m) for m in reported]
    views = [m for m in reported if m >= 0]
    if not views:
        return None, held
    floor = min(views) if len(views) == len(reported) else 0
    out = [max(0, m - floor) for m in reported]
    return (out if any(out) else None), held


def load_order(
    ready: Sequence[L], weights: Sequence[int], per_load: Sequence[float]
) -> list[tuple[float, float]]:
    """Per candidate, where load alone decides (a hot prefix's spread, prompts that share
    nothing): first the requests still waiting for their first byte (queued or in
    prefill: what a new request's first token waits behind; a decoding request costs it
    little), then the load."""
    return [
        (c.awaiting_first / w, load) for c, w, load in zip(ready, weights, per_load, strict=True)
    ]
