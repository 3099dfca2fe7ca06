"""An engine's prefill rate (prompt tokens per second) learned from its own metrics (pure).

Each load round reads three cumulative figures of the engine (:class:`PrefillCounters`):
the prompt tokens of its requests, those of them it found in its prefix cache (not
computed), and the seconds its requests spent in prefill. Between two readings the
engine computed ``Δprompt - Δcached`` tokens in ``Δseconds`` of prefill: one sample of
its rate. Readings are gathered until the window holds at least ``min_seconds`` of
prefill and ``min_tokens`` computed tokens (one short request's figures are mostly the
step around it), and the samples are smoothed (an exponentially weighted mean, weight
``weight``). A counter that goes back (the engine restarted) starts a new window and
keeps the rate: it is the hardware's and the model's, not the process's.

Where the seconds come from differs by engine: vLLM's ``request_prefill_time_seconds``
(scheduled to first token), llama.cpp's ``prompt_seconds_total``, SGLang's time to first
token (it has no prefill histogram; the queue is in it, so its rate is a lower bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["PrefillCounters", "PrefillRate"]


@dataclass(frozen=True, slots=True)
class PrefillCounters:
    """An engine's cumulative prefill figures at one reading."""

    prompt_tokens: float
    cached_tokens: float
    seconds: float


class PrefillRate:
    """The smoothed prompt tokens per second of prefill, from successive readings."""

    def __init__(
        self, *, min_seconds: float = 0.05, min_tokens: float = 64, weight: float = 0.2
    ) -> None:
        self.min_seconds = min_seconds
        self.min_tokens = min_tokens
        self.weight = weight
        # Tokens per second; 0 until one window is complete.
        self.rate = 0.0
        self._start: PrefillCounters | None = None

    def update(self, now: PrefillCounters | None) -> float:
        """Takes one reading (None: the engine did not say) and returns the rate."""
        if now is None or not all(
            math.isfinite(v) and v >= 0 for v in (now.prompt_tokens, now.cached_tokens, now.seconds)
        ):
            return self.rate
        start = self._start
        if (
            start is None
            or now.prompt_tokens < start.prompt_tokens
            or now.cached_tokens < start.cached_tokens
            or now.seconds < start.seconds
        ):
            # The first reading, or the counters went back (a new engine process).
            self._start = now
            return self.rate
        seconds = now.seconds - start.seconds
        computed = (now.prompt_tokens - start.prompt_tokens) - (
            now.cached_tokens - start.cached_tokens
        )
        if seconds < self.min_seconds or computed < self.min_tokens:
            return self.rate  # the window goes on
        sample = computed / seconds
        self.rate = sample if self.rate <= 0 else self.rate + self.weight * (sample - self.rate)
        self._start = now
        return self.rate
