"""Balancers: which endpoint of a model's candidates takes the next request.

Pure: a balancer sees the candidates, a predicate that says which are usable now,
an optional session key and the request's prompt prefix blocks (see prefix.py). It
never returns an unusable endpoint; it returns None only when no candidate is usable.
"""

from __future__ import annotations

import hashlib
import math
import random
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from llmgw_router.config import CacheAwareConfig

__all__ = [
    "Balancer",
    "CacheAware",
    "Candidate",
    "LeastOutstanding",
    "LoadedCandidate",
    "RoundRobin",
    "SessionAffinity",
    "make_balancer",
    "rendezvous_owner",
]


class Candidate(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def weight(self) -> int: ...
    @property
    def outstanding(self) -> int: ...


C = TypeVar("C", bound=Candidate)


class Balancer(Generic[C]):
    def pick(
        self,
        candidates: Sequence[C],
        usable: Callable[[C], bool],
        key: str | None,
        prefix: Sequence[int] = (),
    ) -> C | None:
        raise NotImplementedError

    def forget(self, endpoint_id: str) -> None:
        """The engine behind ``endpoint_id`` changed: drop what was learnt about it."""

    def remembered(self, endpoint_id: str) -> int:
        """How many prefix blocks this balancer remembers sending to ``endpoint_id``."""
        return 0


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

    def pick(
        self,
        candidates: Sequence[C],
        usable: Callable[[C], bool],
        key: str | None,
        prefix: Sequence[int] = (),
    ) -> C | None:
        return least_outstanding([c for c in candidates if usable(c)], self.rng)


class RoundRobin(Balancer[C]):
    """Each usable candidate in turn; weights are not considered."""

    def __init__(self) -> None:
        self.counter = 0

    def pick(
        self,
        candidates: Sequence[C],
        usable: Callable[[C], bool],
        key: str | None,
        prefix: Sequence[int] = (),
    ) -> C | None:
        ready = [c for c in candidates if usable(c)]
        if not ready:
            return None
        self.counter += 1
        return ready[(self.counter - 1) % len(ready)]


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

    def pick(
        self,
        candidates: Sequence[C],
        usable: Callable[[C], bool],
        key: str | None,
        prefix: Sequence[int] = (),
    ) -> C | None:
        if key:
            owner = rendezvous_owner(candidates, key)
            if owner is not None and usable(owner):
                return owner
        return least_outstanding([c for c in candidates if usable(c)], self.rng)


class LoadedCandidate(Candidate, Protocol):
    @property
    def load(self) -> float: ...
    @property
    def generation(self) -> int: ...


L = TypeVar("L", bound=LoadedCandidate)

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit value, the same in every process."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class _PrefixIndex:
    """Prefix blocks this router recently sent to one endpoint, with when (a counter)."""

    __slots__ = ("blocks", "generation", "tick")

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.blocks: dict[int, int] = {}
        self.tick = 0

    def match(self, prefix: Sequence[int]) -> int:
        """How many leading blocks of ``prefix`` were sent here.

        Block hashes are chained (each covers the whole prefix up to it), and a block is
        evicted no earlier than the deeper blocks recorded with it, so presence is
        monotone along the prefix and a binary search finds its end.
        """
        blocks = self.blocks
        if not prefix or prefix[0] not in blocks:
            return 0
        lo, hi = 1, len(prefix)  # prefix[:lo] matched; prefix[hi:] not known to
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if prefix[mid - 1] in blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def record(self, prefix: Sequence[int], capacity: int) -> None:
        self.tick += 1
        self.blocks.update(dict.fromkeys(prefix, self.tick))
        if len(self.blocks) > capacity:
            # The least recently sent quarter goes at once: eviction costs O(1) a block.
            keep = max(1, capacity * 3 // 4)
            recent = sorted(self.blocks.items(), key=lambda kv: kv[1])[-keep:]
            self.blocks = dict(recent)


class CacheAware(Balancer[L]):
    """Prefix affinity bounded by load: the default balancer.

    - Affinity: the request's prefix blocks (chained hashes of its prompt, see prefix.py)
      rank the endpoints by rendezvous hashing of the block at depth ``affinity_blocks``
      (or the last, for shorter prompts), so routers that never talk agree on where a
      prefix goes. What this router itself sent refines that: an endpoint that was sent
      more of this prefix than the rendezvous block covers ranks first.
    - Load: each candidate's ``load`` (the engine's running + waiting requests and KV use
      plus this router's requests since that report, or this router's own in-flight count
      when the engine's figures are unknown or stale).
    - Bounded load: the first endpoint in that ranking whose load, with this request, stays
      within ``ceil((1 + epsilon) * (total + 1) * weight / total_weight)`` takes it; so one
      hot prefix spreads over as many endpoints as its load needs, in the same order on
      every router. When none is within the bound (never with whole-number loads), the
      least loaded takes it.
    - Without a prefix (embeddings), the least loaded takes it.

    An endpoint whose ``generation`` changes (a restarted engine) loses its prefix history.
    """

    def __init__(
        self,
        *,
        epsilon: float = 0.25,
        affinity_blocks: int = 8,
        index_blocks: int = 16384,
        rng: random.Random | None = None,
    ) -> None:
        self.epsilon = epsilon
        self.affinity_blocks = affinity_blocks
        self.index_blocks = index_blocks
        self.rng = rng or random.Random()
        self._indexes: dict[str, _PrefixIndex] = {}
        self._id_hashes: dict[str, int] = {}
        self._turn = 0
        self._last_matched: set[int] = set()

    # -------------------------------------------------------------- prefix state

    def forget(self, endpoint_id: str) -> None:
        self._indexes.pop(endpoint_id, None)

    def remembered(self, endpoint_id: str) -> int:
        index = self._indexes.get(endpoint_id)
        return len(index.blocks) if index is not None else 0

    def _index(self, c: L) -> _PrefixIndex | None:
        index = self._indexes.get(c.id)
        if index is not None and index.generation != c.generation:
            del self._indexes[c.id]
            return None
        return index

    def matched(self, c: L, prefix: Sequence[int]) -> int:
        """Leading blocks of ``prefix`` this router sent to ``c`` (its current engine)."""
        index = self._index(c)
        return index.match(prefix) if index is not None else 0

    def _record(self, c: L, prefix: Sequence[int]) -> None:
        if not prefix or self.index_blocks <= 0:
            return
        index = self._index(c)
        if index is None:
            if len(self._indexes) >= 4096:
                # Endpoints come and go; the oldest entry is the likeliest to be gone.
                self._indexes.pop(next(iter(self._indexes)))
            index = self._indexes[c.id] = _PrefixIndex(c.generation)
        index.record(prefix, self.index_blocks)

    def _ident(self, endpoint_id: str) -> int:
        ident = self._id_hashes.get(endpoint_id)
        if ident is None:
            raw = endpoint_id.encode()
            ident = self._id_hashes[endpoint_id] = zlib.crc32(raw) | (zlib.adler32(raw) << 32)
        return ident

    # -------------------------------------------------------------- the pick

    def ranking(self, ready: Sequence[L], prefix: Sequence[int]) -> list[L]:
        """``ready`` in affinity order for ``prefix``: the same on every router."""
        loads = [c.load / max(1, c.weight) for c in ready]
        return [ready[i] for i in self._ranked(ready, prefix, loads)]

    def _ranked(
        self, ready: Sequence[L], prefix: Sequence[int], per_load: Sequence[float]
    ) -> list[int]:
        depth = min(len(prefix), self.affinity_blocks)
        key = prefix[depth - 1]
        self._turn += 1
        weights = [c.weight for c in ready]
        uniform = all(w == weights[0] for w in weights)
        ranked: list[tuple[int, float, float, str, int]] = []
        indexes = self._indexes
        for i, c in enumerate(ready):
            match = 0
            index = indexes.get(c.id)
            if index is not None:
                if index.generation != c.generation:
                    del indexes[c.id]
                else:
                    match = index.match(prefix)
                    if match <= depth:
                        # Within what the rendezvous block covers: hashing decides.
                        match = 0
            # splitmix64 of the block and the endpoint, inlined (see _mix).
            x = ((key ^ self._ident(c.id)) + 0x9E3779B97F4A7C15) & _MASK
            x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
            x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
            mixed = x ^ (x >> 31)
            # Weighted rendezvous: weight / -ln(u); at equal weights the order of u is enough.
            score = (
                float(mixed) if uniform else max(1, c.weight) / -math.log((mixed + 1) / (2**64 + 2))
            )
            if match:
                # Among endpoints this router knows to hold the prefix (a hot prefix soon
                # is on all of them), the less loaded first, and equals in turn (a
                # counter, so two routers with one history still agree).
                x = ((self._ident(c.id) ^ self._turn) * 0x9E3779B97F4A7C15) & _MASK
                ranked.append((match, -per_load[i], float(x ^ (x >> 29)), c.id, i))
            else:
                ranked.append((0, 0.0, score, c.id, i))
        ranked.sort(reverse=True)
        self._last_matched = {r[4] for r in ranked if r[0]}
        return [r[4] for r in ranked]

    def pick(
        self,
        candidates: Sequence[L],
        usable: Callable[[L], bool],
        key: str | None,
        prefix: Sequence[int] = (),
    ) -> L | None:
        ready = [c for c in candidates if usable(c)]
        if not ready:
            return None
        if len(ready) == 1:
            chosen = ready[0]
        else:
            loads = [c.load for c in ready]
            weights = [max(1, c.weight) for c in ready]
            per_load = [load / w for load, w in zip(loads, weights, strict=True)]
            if prefix:
                # Bounded load: with this request, within ceil((1 + eps) x the mean share).
                per_weight = (1.0 + self.epsilon) * (sum(loads) + 1.0) / sum(weights)
                order = self._ranked(ready, prefix, per_load)
                allowed = [i for i in order if loads[i] + 1.0 <= math.ceil(per_weight * weights[i])]
                best = allowed[0] if allowed else None
                if best is not None and best not in self._last_matched and len(allowed) > 1:
                    # A prefix this router has not sent anywhere yet: the less loaded of its
                    # first two rendezvous choices (two choices, both the same on every
                    # router), so unshared prompts balance nearly as well as by load alone.
                    second = allowed[1]
                    if second not in self._last_matched and per_load[second] < per_load[best]:
                        best = second
                if best is None:
                    # Ties go to the earlier in the ranking: still the same on every router.
                    best = min(order, key=per_load.__getitem__)
                chosen = ready[best]
            else:
                least = min(per_load)
                chosen = self.rng.choice(
                    [c for c, load in zip(ready, per_load, strict=True) if load == least]
                )
        self._record(chosen, prefix)
        return chosen


def make_balancer(
    name: str, rng: random.Random | None = None, *, cache_aware: CacheAwareConfig | None = None
) -> Balancer[Any]:
    if name == "cache_aware":
        if cache_aware is None:
            return CacheAware()
        return CacheAware(
            epsilon=cache_aware.epsilon,
            affinity_blocks=cache_aware.affinity_blocks,
            index_blocks=cache_aware.index_blocks,
        )
    if name == "least_outstanding":
        return LeastOutstanding(rng)
    if name == "round_robin":
        return RoundRobin()
    if name == "session_affinity":
        return SessionAffinity(rng)
    raise ValueError(f"unknown balancer {name!r}")
