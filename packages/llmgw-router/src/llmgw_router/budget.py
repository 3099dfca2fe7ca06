"""The retry budget: how many retries the router may spend, fleet-wide.

A bucket of retry tokens: each first attempt deposits ``ratio`` tokens and time
adds ``min_per_second``; a retry takes one. When engines fail together the
retries stay a fraction of the traffic instead of multiplying it.
"""

from __future__ import annotations

__all__ = ["RetryBudget"]


class RetryBudget:
    def __init__(self, ratio: float, min_per_second: float, *, now: float = 0.0) -> None:
        self.ratio = ratio
        self.min_per_second = min_per_second
        # Room for a second's floor plus what a hundred requests earn.
        self.capacity = max(1.0, min_per_second + 100 * ratio)
        self.tokens = self.capacity
        self._last = now

    def _refill(self, now: float) -> None:
        elapsed = now - self._last
        if elapsed > 0:
            self.tokens = min(self.capacity, self.tokens + elapsed * self.min_per_second)
            self._last = now

    def on_request(self, now: float) -> None:
        self._refill(now)
        self.tokens = min(self.capacity, self.tokens + self.ratio)

    def try_spend(self, now: float) -> bool:
        self._refill(now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False
