"""What a cache-aware router remembers sending to one endpoint (its prefix blocks), and
the order it first ranked the endpoints in."""

from __future__ import annotations

import functools
import zlib
from collections import OrderedDict
from collections.abc import Sequence

from llmgw_router.balancing.base import Candidate

__all__ = ["MASK", "FirstSeen", "PrefixIndex", "endpoint_ident", "mix"]

MASK = (1 << 64) - 1


@functools.lru_cache(maxsize=4096)
def endpoint_ident(endpoint_id: str) -> int:
    """An endpoint id's (or slot's) 64-bit identity in the rendezvous ranking, the same in
    every process; the last 4,096 ids' are kept (a fleet's churn of ids stays bounded)."""
    raw = endpoint_id.encode()
    return zlib.crc32(raw) | (zlib.adler32(raw) << 32)


def mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit value, the same in every process."""
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


class FirstSeen:
    """The order endpoints were first ranked in (id -> rank, oldest lowest), at most
    ``limit`` ids besides the candidates of the moment: at the limit, the ids that are
    not candidates are cut to the newest half of it (the oldest are the likeliest gone)
    and what is kept is renumbered in its order, so the candidates keep theirs."""

    __slots__ = ("limit", "ranks")

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self.ranks: dict[str, int] = {}

    def order(self, ready: Sequence[Candidate]) -> dict[str, int]:
        """The ranks (cut first where at the limit); a new id takes ``len(ranks)``."""
        ranks = self.ranks
        if len(ranks) >= self.limit:
            here = {c.id for c in ready}
            others = [e for e in ranks if e not in here]
            keep = here.union(others[max(0, len(others) - self.limit // 2) :])
            ranks = self.ranks = {e: n for n, e in enumerate(e for e in ranks if e in keep)}
        return ranks


class PrefixIndex:
    """Prefix blocks this router sent to one endpoint, least recently sent first (an LRU
    as large as the engine's cache where that is known, so what it drops the engine has
    most likely evicted too), and of them the ``live`` ones: sent within the horizon."""

    __slots__ = ("blocks", "generation", "live")

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.blocks: OrderedDict[int, int] = OrderedDict()
        self.live: OrderedDict[int, int] = OrderedDict()

    def match(self, prefix: Sequence[int]) -> int:
        """How many leading blocks of ``prefix`` were sent here.

        Block hashes are chained (each covers the whole prefix up to it), and a block is
        evicted no earlier than the deeper blocks recorded with it (they are recorded
        deepest first, so the shallower are the more recent), so presence is monotone
        along the prefix and a binary search finds its end.
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

    def record(self, prefix: Sequence[int], capacity: int, tick: int) -> None:
        blocks, live = self.blocks, self.live
        for block in reversed(prefix):
            blocks[block] = tick
            blocks.move_to_end(block)
            live[block] = tick
            live.move_to_end(block)
        while len(blocks) > capacity:
            old, _ = blocks.popitem(last=False)
            live.pop(old, None)

    def footprint(self, since: int) -> int:
        """Blocks sent here at tick ``since`` or later and not evicted since."""
        live = self.live
        while live:
            block = next(iter(live))
            if live[block] >= since:
                break
            del live[block]
        return len(live)
