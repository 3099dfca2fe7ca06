"""Held requests in order, as pure state: a queue per priority band, and within a band
fair share by weight among keys (start-time fair queueing: virtual time).

- :meth:`FairQueue.pop` always serves the highest band that holds anything: a band
  never waits while a lower one is served.
- Within a band each key's requests get virtual finish tags ``max(band time, the
  key's last tag) + 1 / weight``, and the smallest tag goes first. A key that floods
  queues behind its own requests: a newcomer's first request is tagged at the band's
  current time plus one step, so it waits for at most about one request of every
  other key (scaled by weights), never for the flood.
- :meth:`FairQueue.shed` picks the victim when the queue is over its bound: the
  newest request of the lowest band that holds any.
- Items can be removed (deadline passed, client gone) at any time.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["FairQueue", "Held"]

T = TypeVar("T")


@dataclass(order=True, slots=True)
class Held(Generic[T]):
    """One held item: ordered by its finish tag, then arrival."""

    tag: float
    seq: int
    band: int = field(compare=False)
    key: str = field(compare=False)
    item: T = field(compare=False)
    start: float = field(compare=False, default=0.0)
    gone: bool = field(compare=False, default=False)


class _Band(Generic[T]):
    __slots__ = ("heap", "last", "live", "vtime")

    def __init__(self) -> None:
        self.heap: list[Held[T]] = []
        self.vtime = 0.0
        # Per key: the last finish tag given, and how many of its items are live.
        self.last: dict[str, float] = {}
        self.live: dict[str, int] = {}


class FairQueue(Generic[T]):
    """Bands 0 (highest) .. n-1; keys within a band by weight."""

    def __init__(self, bands: int) -> None:
        if bands < 1:
            raise ValueError("at least one band")
        self._bands: list[_Band[T]] = [_Band() for _ in range(bands)]
        self._seq = itertools.count()
        # Held items in all bands (what len() returns; read directly on the hot path).
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def push(self, item: T, band: int, key: str, weight: float = 1.0) -> Held[T]:
        if weight <= 0:
            raise ValueError("weight must be > 0")
        b = self._bands[band]
        start = max(b.vtime, b.last.get(key, 0.0))
        tag = start + 1.0 / weight
        b.last[key] = tag
        b.live[key] = b.live.get(key, 0) + 1
        held = Held(tag, next(self._seq), band, key, item, start)
        heapq.heappush(b.heap, held)
        self.size += 1
        return held

    def remove(self, held: Held[T]) -> bool:
        """Take ``held`` out (lazily); False when it was no longer queued."""
        if held.gone:
            return False
        held.gone = True
        self._forget(held)
        return True

    def _forget(self, held: Held[T]) -> None:
        b = self._bands[held.band]
        self.size -= 1
        left = b.live[held.key] - 1
        if left:
            b.live[held.key] = left
        else:
            # The key is idle: it starts again at the band's time, with no credit saved.
            del b.live[held.key]
            b.last.pop(held.key, None)

    def pop(self) -> Held[T] | None:
        """The next item to serve: the highest band's smallest tag."""
        for b in self._bands:
            heap = b.heap
            while heap:
                held = heapq.heappop(heap)
                if held.gone:
                    continue
                held.gone = True
                b.vtime = max(b.vtime, held.start)
                self._forget(held)
                return held
        return None

    def peek(self) -> Held[T] | None:
        """What :meth:`pop` would serve now, left in place; None when nothing is held."""
        for b in self._bands:
            heap = b.heap
            while heap and heap[0].gone:
                heapq.heappop(heap)
            if heap:
                return heap[0]
        return None

    def next_band(self) -> int | None:
        """The band :meth:`pop` would serve now; None when nothing is held."""
        held = self.peek()
        return None if held is None else held.band

    def shed(self) -> Held[T] | None:
        """The victim when over the bound: the newest item of the lowest band holding any."""
        for b in reversed(self._bands):
            live = [h for h in b.heap if not h.gone]
            if live:
                victim = max(live, key=lambda h: h.seq)
                self.remove(victim)
                return victim
        return None

    def items(self) -> Iterator[Held[T]]:
        for b in self._bands:
            for held in b.heap:
                if not held.gone:
                    yield held

    def lengths(self) -> list[dict[str, int]]:
        """Per band: held items per key."""
        return [dict(b.live) for b in self._bands]
