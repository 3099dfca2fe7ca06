"""The simple balancers: least outstanding (power of two choices), round robin and
session affinity (weighted rendezvous hashing)."""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Sequence

from llmgw_router.balancing.base import Balancer, C, Pick

__all__ = [
    "LeastOutstanding",
    "RoundRobin",
    "SessionAffinity",
    "least_outstanding",
    "rendezvous_owner",
]


def _two_distinct(usable: Sequence[C], rng: random.Random) -> tuple[C, C]:
    """Two different candidates, each drawn with probability proportional to its weight."""
    n = len(usable)
    first_weight = usable[0].weight
    if all(c.weight == first_weight for c in usable):
        i = rng.randrange(n)
        j = rng.randrange(n - 1)
        if j >= i:
            j += 1
        return usable[i], usable[j]
    weights = [max(1, c.weight) for c in usable]
    (i,) = rng.choices(range(n), weights=weights)
    rest = [k for k in range(n) if k != i]
    (j,) = rng.choices(rest, weights=[weights[k] for k in rest])
    return usable[i], usable[j]


def least_outstanding(usable: Sequence[C], rng: random.Random) -> C | None:
    """Power of two random choices: of two weighted draws, the one with less load per weight."""
    if not usable:
        return None
    if len(usable) == 1:
        return usable[0]
    a, b = _two_distinct(usable, rng)
    # outstanding/weight compared without division; a tie keeps the first (weighted) draw.
    if b.outstanding * a.weight < a.outstanding * b.weight:
        return b
    return a


class LeastOutstanding(Balancer[C]):
    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def choose(
        self,
        candidates: Sequence[C],
        usable: Callable[[C], bool],
        key: str | None,
        prefix: Sequence[int] = (),
        cached: Callable[[C], int] | None = None,
        *,
        at: float,
    ) -> Pick[C]:
        chosen = least_outstanding([c for c in candidates if usable(c)], self.rng)
        return Pick(chosen, "least_loaded" if chosen is not None else "none")


class RoundRobin(Balancer[C]):
    """Each usable candidate in turn; weights are not considered."""

    def __init__(self) -> None:
        self.counter = 0

    def choose(
        self,
        candidates: Sequence[C],
        usable: Callable[[C], bool],
        key: str | None,
        prefix: Sequence[int] = (),
        cached: Callable[[C], int] | None = None,
        *,
        at: float,
    ) -> Pick[C]:
        ready = [c for c in candidates if usable(c)]
        if not ready:
            return Pick(None, "none")
        self.counter += 1
        return Pick(ready[(self.counter - 1) % len(ready)], "round_robin")


def _unit_hash(key: str, endpoint_id: str) -> float:
    digest = hashlib.blake2b(f"{key}\x00{endpoint_id}".encode(), digest_size=8).digest()
    # In (0, 1): both ends excluded so the log below is finite and non-zero.
    return (int.from_bytes(digest, "big") + 1) / (2**64 + 2)


def rendezvous_owner(candidates: Sequence[C], key: str) -> C | None:
    """Weighted rendezvous (highest random weight) hashing: the owner of ``key``.

    Removing or adding one candidate moves only the keys that it owns (or wins),
    which is the consistency session affinity needs.
    """
    best: C | None = None
    best_score = -math.inf
    for c in candidates:
        score = max(1, c.weight) / -math.log(_unit_hash(key, c.id))
        if score > best_score or (score == best_score and best is not None and c.id < best.id):
            best, best_score = c, score
    return best


class SessionAffinity(Balancer[C]):
    """Requests with the same key go to the same endpoint while it is usable."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def choose(
        self,
        candidates: Sequence[C],
        usable: Callable[[C], bool],
        key: str | None,
        prefix: Sequence[int] = (),
        cached: Callable[[C], int] | None = None,
        *,
        at: float,
    ) -> Pick[C]:
        if key:
            owner = rendezvous_owner(candidates, key)
            if owner is not None and usable(owner):
                return Pick(owner, "session")
        chosen = least_outstanding([c for c in candidates if usable(c)], self.rng)
        return Pick(chosen, "least_loaded" if chosen is not None else "none")
