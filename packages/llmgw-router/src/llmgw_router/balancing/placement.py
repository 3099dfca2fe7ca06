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

Held prefixes (``held``: where the fleet's routers sent most of a prefix's requests,
which holds it cached): a held prefix proposes to its holder first, and an endpoint
prefers the prefixes it holds to any it does not (among them, by score). So a held
prefix keeps its home while the prefixes its holder holds fit its cache (its whole
cache, ``whole``, not less the reserve the rule keeps when it places: a move is a miss,
and a reserve alone had homes go round in cycles of moves); where they do not, the holder keeps those it prefers and the rest are placed by
the rule like new ones, into what room the other endpoints have left; a held prefix
no endpoint keeps goes where the least of the cache would be used with it (its holder
among equals). (Following every holder whatever it held let an engine that took too
many tenants early keep them all: through 4 routers one engine took a third of the
requests at 74-76 % hits.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

__all__ = ["balanced_home", "place"]


def balanced_home(
    order: Sequence[int], homed: Sequence[int], weights: Sequence[int], current: int | None
) -> tuple[int, list[bool]]:
    """A prefix's home where one router places prefixes alone (no shared rule): the
    first endpoint in the prefix's rendezvous ``order`` that is under its share of the
    placed prefixes, ``homed[i] < ceil(k * weights[i] / sum(weights))`` with ``k`` the
    placed prefixes this one included (``homed``: per endpoint, those homed there, this
    one not counted). A prefix with a ``current`` home keeps it unless an endpoint it
    ranks higher is under its share and would, with it, still be home to fewer than its
    current home is (weighed: ``(2t + 1) / w_t < (2c - 1) / w_c``, so the sum over the
    endpoints of homed squared per weight falls with every move). And, per endpoint,
    whether it is under its share.

    Rendezvous hashing alone gives 32 prefixes over 4 engines as 11, 9, 6 and 6 as often
    as 8 each, and the engine with 11 queues while the others idle (requests per engine
    max/mean 1.2-1.3 where every prefix fits). Here no endpoint takes more than its share
    (rounded up) by placing; a prefix moves only up its order and only to even the
    counts (so moves end), and an endpoint that joins takes the prefixes that rank it
    above their home until it is home to about as many as the others. Some endpoint is
    always under its share: the shares sum to at least ``k``, the homed to ``k - 1``."""
    k = sum(homed) + 1
    total = sum(weights)
    under = [h < math.ceil(k * w / total) for h, w in zip(homed, weights, strict=True)]
    if current is None:
        return next(i for i in order if under[i]), under
    c, wc = homed[current] + 1, weights[current]
    for i in order:
        if i == current:
            break
        if under[i] and (2 * homed[i] + 1) * wc < (2 * c - 1) * weights[i]:
            return i, under
    return current, under


def place(
    ranks: Mapping[int, Sequence[tuple[int, float]]],
    sizes: Mapping[int, int],
    capacities: Sequence[int],
    held: Mapping[int, int] | None = None,
    *,
    fit: bool = True,
    whole: Sequence[int] | None = None,
) -> dict[int, int]:
    """Each prefix's home, as an endpoint position.

    ``ranks``: per prefix key, its endpoints (positions) best first, each with the
    prefix's score for it (a higher score: the endpoint prefers it more; ties broken by
    the key). ``sizes``: each prefix's size in blocks. ``capacities``: each endpoint's
    cache in blocks, 0 where not known (it keeps every prefix offered). ``held``: per
    held prefix, its holder's position (see the module): tried first, and there
    preferred to every prefix that endpoint does not hold, and kept within ``whole``
    (each endpoint's whole cache, where ``capacities`` leave a reserve: what the holder
    already holds does not move to make room for the reserve). ``fit=False`` (the rule
    before, for comparison): a held prefix's home is its holder whatever else it holds,
    the rest placed as if nothing were held."""
    n = len(capacities)
    if not fit:
        homes = place(ranks, sizes, capacities, None, fit=True)
        homes.update((k, at) for k, at in (held or {}).items() if k in ranks and 0 <= at < n)
        return homes
    held = {k: at for k, at in (held or {}).items() if k in ranks and 0 <= at < n}
    # Each prefix's proposals in order: its holder first where it has one.
    prefs = {
        key: [(at, 1, s) for at, s in choices if at == held[key]]
        + [(at, 0, s) for at, s in choices if at != held[key]]
        if key in held
        else [(at, 0, s) for at, s in choices]
        for key, choices in ranks.items()
    }
    nxt = dict.fromkeys(ranks, 0)
    # Per endpoint: the prefixes it keeps now, as (held there, score, key).
    kept: list[list[tuple[int, float, int]]] = [[] for _ in range(n)]
    free = sorted(ranks)
    unplaced: list[int] = []
    while free:
        offers: dict[int, list[tuple[int, float, int]]] = {}
        for key in free:
            choices = prefs[key]
            i = nxt[key]
            if i >= len(choices):
                unplaced.append(key)
                continue
            nxt[key] = i + 1
            at, holds, score = choices[i]
            offers.setdefault(at, []).append((holds, score, key))
        free = []
        for at in sorted(offers):
            pool = kept[at] + offers[at]
            capacity = capacities[at]
            if capacity <= 0:
                kept[at] = pool
                continue
            pool.sort(reverse=True)
            used = 0
            keep: list[tuple[int, float, int]] = []
            for entry in pool:
                size = sizes.get(entry[2], 1)
                if used + size <= (max(capacity, whole[at]) if whole and entry[0] else capacity):
                    keep.append(entry)
                    used += size
                else:
                    free.append(entry[2])
            kept[at] = keep
        free.sort()
    homes = {entry[2]: at for at in range(n) for entry in kept[at]}
    filled = [sum(sizes.get(entry[2], 1) for entry in kept[at]) for at in range(n)]
    for key in unplaced:
        if key not in held:
            homes[key] = at = ranks[key][0][0]
            filled[at] += sizes.get(key, 1)
    # A held prefix no endpoint keeps goes where the least of the cache would be used
    # with it (the caches' reserve takes it: the rule fills each cache less an eighth),
    # its holder first among equals, then in its rendezvous order; in key order. (Each
    # to its first choice, as the others, moved it again and again; each to its holder
    # put back on an over-full holder what it could not keep.)
    for key in sorted(k for k in unplaced if k in held):
        size, holder = sizes.get(key, 1), held[key]

        def fill(at: int, size: int = size, holder: int = holder) -> tuple[float, bool]:
            cap = capacities[at]
            return ((filled[at] + size) / cap if cap > 0 else 0.0, at != holder)

        homes[key] = at = min((at for at, _ in ranks[key]), key=fill)  # equals: the first
        filled[at] += size
    return homes
