"""Exponential backoff with full jitter.

A fleet that loses its control plane at the same moment must not come back in
lockstep: each delay is drawn uniformly from [0, min(cap, base * 2**attempt)],
the "full jitter" scheme, which spreads reconnects over the whole window.
"""

from __future__ import annotations

import random
from collections.abc import Callable

__all__ = ["Backoff", "exponential", "full_jitter"]


def exponential(attempt: int, base: float, cap: float) -> float:
    """The un-jittered delay ceiling for ``attempt`` (0-based): base * 2**attempt, capped."""
    if attempt < 0:
        raise ValueError("attempt must be >= 0")
    if base <= 0 or cap < base:
        raise ValueError("need 0 < base <= cap")
    # 2**attempt overflows float for huge attempts; the cap is reached long before.
    if attempt >= 64:
        return cap
    return min(cap, base * 2.0**attempt)


def full_jitter(attempt: int, base: float, cap: float, uniform: Callable[[], float]) -> float:
    """A delay drawn from [0, exponential(attempt)] using ``uniform`` in [0, 1)."""
    return exponential(attempt, base, cap) * uniform()


class Backoff:
    """Stateful helper: ``next()`` gives the next delay, ``reset()`` after a success."""

    def __init__(self, base: float, cap: float, *, rng: random.Random | None = None) -> None:
        exponential(0, base, cap)  # validates
        self.base = base
        self.cap = cap
        self.attempt = 0
        self._rng = rng or random.Random()

    def next(self) -> float:
        delay = full_jitter(self.attempt, self.base, self.cap, self._rng.random)
        self.attempt += 1
        return delay

    def reset(self) -> None:
        self.attempt = 0
