"""cache_aware's shared placement rule (pure): each prefix's home, computed from what
every router of a fleet has alike, so that routers that never talk agree.

The inputs are the endpoints (their ids, weights and cache sizes, as the engines report
them or the operator configures them) and the prefixes recently seen (each by its
rendezvous block and its size in prefix blocks: what the prompt is, not where this
router sent it). No router's own sends, loads or times enter it.

The rule is a stable matching (deferred acceptance) between prefixes and endpoints with
capacities: a prefix prefers the endpoints in its rendezvous order; an endpoint prefers
the prefixes with the higher rendezvous score for it and keeps, in that order, those
that fit its cache. A prefix no endpoint keeps goes to its first rendezvous choice.
Where every prefix fits at its first choice (a roomy cache, or cache sizes not known)
each home is its first rendezvous choice: plain rendezvous hashing.

Two routers that saw the same prefixes compute the same homes; a prefix one of them has
not seen yet changes only the homes of prefixes an endpoint prefers less than it (an
endpoint's favourite prefixes keep their home whatever else it is offered).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["place"]


def place(
    ranks: Mapping[int, Sequence[tuple[int, float]]],
    sizes: Mapping[int, int],
    capacities: Sequence[int],
) -> dict[int, int]:
    """Each prefix's home, as an endpoint position.

    ``ranks``: per prefix key, its endpoints (positions) best first, each with the
    prefix's score for it (a higher score: the endpoint prefers it more; ties broken by
    the key). ``sizes``: each prefix's size in blocks. ``capacities``: each endpoint's
    cache in blocks, 0 where not known (it keeps every prefix offered)."""
    n = len(capacities)
    nxt = dict.fromkeys(ranks, 0)
    # Per endpoint: the prefixes it keeps now, as (score, key).
    kept: list[list[tuple[float, int]]] = [[] for _ in range(n)]
    free = sorted(ranks)
    unplaced: list[int] = []
    while free:
        offers: dict[int, list[tuple[float, int]]] = {}
        for key in free:
            choices = ranks[key]
            i = nxt[key]
            if i >= len(choices):
                unplaced.append(key)
                continue
            nxt[key] = i + 1
            at, score = choices[i]
            offers.setdefault(at, []).append((score, key))
        free = []
        for at in sorted(offers):
            pool = kept[at] + offers[at]
            capacity = capacities[at]
            if capacity <= 0:
                kept[at] = pool
                continue
            pool.sort(reverse=True)
            used = 0
            keep: list[tuple[float, int]] = []
            for score, key in pool:
                size = sizes.get(key, 1)
                if used + size <= capacity:
                    keep.append((score, key))
                    used += size
                else:
                    free.append(key)
            kept[at] = keep
        free.sort()
    homes = {key: at for at in range(n) for _, key in kept[at]}
    for key in unplaced:
        homes[key] = ranks[key][0][0]
    return homes
