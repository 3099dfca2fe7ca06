"""Per-key limits as pure state: token buckets for requests and tokens per minute, a
concurrency count, and a budget grant. No clock is read here: every call takes `now`.

A bucket holds at most `capacity` (the per-minute limit, this router's share of it)
and refills at capacity / 60 per second, as OpenAI's limits do. A request reserves
one request and its estimated tokens at admission; the token reservation is
corrected when the usage is known (the unused part goes back, an overrun is taken,
and may leave the bucket below zero: later requests wait for it). Nothing is ever
admitted that the bucket (or the budget grant, or the concurrency limit) cannot
cover at that moment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from math import ceil

__all__ = [
    "Bucket",
    "KeyLimits",
    "KeyState",
    "Refusal",
    "Reservation",
    "both_lines",
    "head_format",
    "reset_text",
]


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """A key's limits; 0 means unlimited (budget: none)."""

    rpm: float = 0.0
    tpm: float = 0.0
    max_concurrent: int = 0
    budget_tokens: int = 0

    @property
    def limited(self) -> bool:
        return bool(self.rpm or self.tpm or self.max_concurrent or self.budget_tokens)

    def scaled(self, fraction: float) -> KeyLimits:
        """These limits times ``fraction`` (a router's or a worker's part); a limit that is
        set never drops to 0 (unlimited): at least one request, one token, one at a time."""
        return KeyLimits(
            rpm=max(1.0, self.rpm * fraction) if self.rpm else 0.0,
            tpm=max(1.0, self.tpm * fraction) if self.tpm else 0.0,
            max_concurrent=(
                max(1, math.floor(self.max_concurrent * fraction)) if self.max_concurrent else 0
            ),
            budget_tokens=self.budget_tokens,
        )


class Bucket:
    """A token bucket: ``capacity`` at most, refilled at capacity / 60 per second."""

    __slots__ = ("at", "capacity", "level", "limit_text", "rate")

    def __init__(self, capacity: float, now: float) -> None:
        # A float: compared with the (float) level on every request, where a large int
        # would take CPython's slow int-to-float path.
        capacity = float(capacity)
        self.capacity = capacity
        self.rate = capacity / 60.0
        self.level = capacity
        self.at = now
        # The x-ratelimit-limit-* value, encoded once per limit.
        self.limit_text = b"%d" % capacity

    def refill(self, now: float) -> None:
        if now > self.at:
            level = self.level + (now - self.at) * self.rate
            self.level = level if level < self.capacity else self.capacity
            self.at = now

    def resize(self, capacity: float, now: float) -> None:
        """A new limit (share): the level keeps what was used against the old one."""
        self.refill(now)
        used = self.capacity - self.level
        capacity = float(capacity)
        self.capacity = capacity
        self.rate = capacity / 60.0
        self.limit_text = b"%d" % capacity
        self.level = min(capacity, capacity - used)

    def lines(self, now: float, names: tuple[bytes, bytes, bytes]) -> list[tuple[bytes, bytes]]:
        """The limit, remaining and reset headers of this bucket (refilled to ``now``)."""
        if now > self.at:
            self.refill(now)
        level = self.level
        missing = self.capacity - level
        return [
            (names[0], self.limit_text),
            (names[1], b"%d" % level if level > 0 else b"0"),
            (names[2], reset_text(missing / self.rate) if missing > 0 else b"0s"),
        ]

    def wait_for(self, amount: float) -> float:
        """Seconds until ``amount`` is available (after :meth:`refill`); inf if never."""
        if amount <= self.level:
            return 0.0
        if amount > self.capacity or self.rate <= 0:
            return math.inf
        return (amount - self.level) / self.rate

    def until_full(self) -> float:
        return 0.0 if self.rate <= 0 else max(0.0, (self.capacity - self.level) / self.rate)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request was not admitted: the limit, a message, seconds until it may be."""

    limit: str  # "rpm", "tpm", "concurrency", "budget", "too_large"
    message: str
    retry_after: float


@dataclass(slots=True)
class Reservation:
    """What one admitted request holds until it ends."""

    tokens: int
    budget: int
    done: bool = False


class KeyState:
    """One key's buckets, in-flight count and budget grant at this router."""

    __slots__ = (
        "budget_left",
        "budget_reserved",
        "head",
        "in_flight",
        "limits",
        "requests",
        "tokens",
        "unreported",
    )

    def __init__(self, limits: KeyLimits, now: float) -> None:
        self.limits = limits
        self.requests = Bucket(limits.rpm, now) if limits.rpm else None
        self.tokens = Bucket(limits.tpm, now) if limits.tpm else None
        # The x-ratelimit-* lines as one bytes template, the limits written in: only
        # the remaining and reset values are formatted per response (head_block).
        self.head = head_format(self.requests, self.tokens)
        self.in_flight = 0
        # The budget: tokens this router may still reserve (its grant), and the tokens
        # reserved by requests in flight.
        self.budget_left = limits.budget_tokens
        self.budget_reserved = 0
        # Tokens used by requests that ended since the usage report now pending (or the
        # next one) was taken: in no grant's count yet, and no longer reserved.
        self.unreported = 0

    def set_limits(self, limits: KeyLimits, now: float) -> None:
        """A new share (or new limits): buckets resized, usage against them kept."""
        self.limits = limits
        self.requests = _resized(self.requests, limits.rpm, now)
        self.tokens = _resized(self.tokens, limits.tpm, now)
        self.head = head_format(self.requests, self.tokens)

    def grant(self, tokens: int) -> None:
        """A new budget grant (the reply to the usage report taken last): what this
        router may reserve from now on, less what the control plane has not counted:
        its requests in flight hold (reserved), and what requests that ended since that
        report was taken used (they are in the next report)."""
        self.budget_left = max(0, tokens - self.budget_reserved - self.unreported)

    def reported(self) -> None:
        """A usage report was taken: what ended before it is in the control plane's count
        once the report is answered."""
        self.unreported = 0

    def new_period(self, tokens: int) -> None:
        """A router-config key's budget for a new period: ``tokens`` less what its
        requests in flight hold."""
        self.unreported = 0
        self.budget_left = max(0, tokens - self.budget_reserved)

    def try_reserve(self, tokens: int, now: float) -> Reservation | Refusal:
        """Admit a request estimated at ``tokens``: all limits at once, or a refusal."""
        limits = self.limits
        requests, bucket = self.requests, self.tokens
        if requests is not None:
            if now > requests.at:  # Bucket.refill, inline (every admitted request)
                level = requests.level + (now - requests.at) * requests.rate
                requests.level = level if level < requests.capacity else requests.capacity
                requests.at = now
            if requests.level < 1.0:
                return Refusal(
                    "rpm",
                    f"rate limit of {_fmt(requests.capacity)} requests per minute reached",
                    requests.wait_for(1.0),
                )
        if bucket is not None:
            if now > bucket.at:
                level = bucket.level + (now - bucket.at) * bucket.rate
                bucket.level = level if level < bucket.capacity else bucket.capacity
                bucket.at = now
            if tokens > bucket.level:
                if tokens > bucket.capacity:
                    return Refusal(
                        "too_large",
                        f"this request needs about {tokens} tokens, more than the limit of "
                        f"{_fmt(bucket.capacity)} tokens per minute",
                        60.0,
                    )
                return Refusal(
                    "tpm",
                    f"rate limit of {_fmt(bucket.capacity)} tokens per minute reached "
                    f"(this request needs about {tokens})",
                    bucket.wait_for(tokens),
                )
        if limits.max_concurrent and self.in_flight >= limits.max_concurrent:
            return Refusal(
                "concurrency",
                f"{limits.max_concurrent} concurrent requests at most; wait for one to end",
                1.0,
            )
        budget = 0
        if limits.budget_tokens:
            if tokens > self.budget_left:
                return Refusal(
                    "budget",
                    f"token budget exhausted (this request needs about {tokens} tokens)",
                    60.0,
                )
            budget = tokens
            self.budget_left -= tokens
            self.budget_reserved += tokens
        if requests is not None:
            requests.level -= 1.0
        if bucket is not None:
            bucket.level -= tokens
        self.in_flight += 1
        return Reservation(tokens, budget)

    def release(self, reservation: Reservation, used: int | None, now: float) -> None:
        """A request ended having used ``used`` tokens (None: not known, the reservation
        stands). The token bucket and the budget are corrected by the difference."""
        if reservation.done:
            return
        reservation.done = True
        self.in_flight -= 1
        actual = reservation.tokens if used is None else used
        bucket = self.tokens
        if bucket is not None and actual != reservation.tokens:
            if now > bucket.at:  # Bucket.refill, inline
                level = bucket.level + (now - bucket.at) * bucket.rate
                bucket.level = level if level < bucket.capacity else bucket.capacity
                bucket.at = now
            bucket.level = min(bucket.capacity, bucket.level + reservation.tokens - actual)
        if reservation.budget:
            self.budget_reserved -= reservation.budget
            self.unreported += actual
            # The budget grant gives back what was not used; an overrun is taken from it.
            self.budget_left = max(0, self.budget_left + reservation.budget - actual)

    def headers(self, now: float) -> list[tuple[bytes, bytes]]:
        """OpenAI's x-ratelimit-* headers for the limits this key has."""
        requests, tokens = self.requests, self.tokens
        if requests is None:
            return [] if tokens is None else tokens.lines(now, _TOKENS)
        if tokens is None:
            return requests.lines(now, _REQUESTS)
        return both_lines(requests, tokens, now, [])

    def head_block(self, now: float) -> bytes:
        """:meth:`headers` as response-head lines in one bytes block ("name: value\\r\\n"
        each, as the head writer writes a header): the limits' template (:func:`head_format`)
        with the remaining and reset values of this moment (the buckets refilled to
        ``now``). Every response of a limited key: both rates inline."""
        requests, tokens = self.requests, self.tokens
        if requests is None or tokens is None:
            return self._one_block(now)
        r_level, r_reset, t_level, t_reset = _both_now(requests, tokens, now)
        return self.head % (
            r_level if r_level > 0 else 0,
            r_reset,
            t_level if t_level > 0 else 0,
            t_reset,
        )

    def _one_block(self, now: float) -> bytes:
        bucket = self.requests or self.tokens
        if bucket is None:
            return b""
        bucket.refill(now)
        level = bucket.level
        missing = bucket.capacity - level
        reset = reset_text(missing / bucket.rate) if missing > 0 else b"0s"
        return self.head % (level if level > 0 else 0, reset)


def head_format(requests: Bucket | None, tokens: Bucket | None) -> bytes:
    """The x-ratelimit-* response-head lines of these buckets as a bytes %-template: the
    names and the limits written in, ``%d`` for each remaining and ``%b`` for each reset
    (requests first). b"" for none."""
    out = b""
    for bucket, names in ((requests, _REQUESTS), (tokens, _TOKENS)):
        if bucket is not None:
            out += b"%b: %b\r\n%b: %%d\r\n%b: %%b\r\n" % (
                names[0],
                bucket.limit_text,
                names[1],
                names[2],
            )
    return out


def _both_now(requests: Bucket, tokens: Bucket, now: float) -> tuple[float, bytes, float, bytes]:
    """Both buckets refilled to ``now`` (Bucket.refill, inline): the requests' level and
    reset text, the tokens' level and reset text. What every response of a key with both
    rates says (:meth:`KeyState.head_block`, :func:`both_lines`)."""
    if now > requests.at:
        level = requests.level + (now - requests.at) * requests.rate
        requests.level = level if level < requests.capacity else requests.capacity
        requests.at = now
    if now > tokens.at:
        level = tokens.level + (now - tokens.at) * tokens.rate
        tokens.level = level if level < tokens.capacity else tokens.capacity
        tokens.at = now
    r_level, t_level = requests.level, tokens.level
    r_missing, t_missing = requests.capacity - r_level, tokens.capacity - t_level
    # reset_text's "<1s" case from a table (a bucket with room to spare refills in ms).
    if r_missing > 0:
        wait = r_missing / requests.rate
        r_reset = _MS[ceil(wait * 1000)] if wait < 1 else reset_text(wait)
    else:
        r_reset = b"0s"
    if t_missing > 0:
        wait = t_missing / tokens.rate
        t_reset = _MS[ceil(wait * 1000)] if wait < 1 else reset_text(wait)
    else:
        t_reset = b"0s"
    return r_level, r_reset, t_level, t_reset


def both_lines(
    requests: Bucket, tokens: Bucket, now: float, before: list[tuple[bytes, bytes]]
) -> list[tuple[bytes, bytes]]:
    """``before`` and then the requests' and the tokens' buckets' lines (Bucket.lines
    twice, inline: every response of a key with both rates)."""
    r_level, r_reset, t_level, t_reset = _both_now(requests, tokens, now)
    return [
        *before,
        (b"x-ratelimit-limit-requests", requests.limit_text),
        (b"x-ratelimit-remaining-requests", b"%d" % r_level if r_level > 0 else b"0"),
        (b"x-ratelimit-reset-requests", r_reset),
        (b"x-ratelimit-limit-tokens", tokens.limit_text),
        (b"x-ratelimit-remaining-tokens", b"%d" % t_level if t_level > 0 else b"0"),
        (b"x-ratelimit-reset-tokens", t_reset),
    ]


_REQUESTS = (
    b"x-ratelimit-limit-requests",
    b"x-ratelimit-remaining-requests",
    b"x-ratelimit-reset-requests",
)
_TOKENS = (
    b"x-ratelimit-limit-tokens",
    b"x-ratelimit-remaining-tokens",
    b"x-ratelimit-reset-tokens",
)
# reset_text of i ms, for i up to 1000 (a wait under a second, rounded up).
_MS = tuple(b"%dms" % max(1, i) for i in range(1001))


def _resized(bucket: Bucket | None, capacity: float, now: float) -> Bucket | None:
    if not capacity:
        return None
    if bucket is None:
        return Bucket(capacity, now)
    bucket.resize(capacity, now)
    return bucket


def _fmt(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:g}"


def reset_text(seconds: float) -> bytes:
    """A duration as OpenAI writes its resets: "1s", "6m0s", "20ms", "1h2m3s"."""
    if seconds <= 0:
        return b"0s"
    if seconds < 1:
        return b"%dms" % max(1, math.ceil(seconds * 1000))
    whole = math.ceil(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return b"%dh%dm%ds" % (hours, minutes, secs)
    if minutes:
        return b"%dm%ds" % (minutes, secs)
    return b"%ds" % secs
