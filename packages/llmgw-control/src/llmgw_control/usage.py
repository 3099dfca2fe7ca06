"""What each key used, by the hour, counted once per router report (pure of I/O).

Routers report each key's usage since their previous report, every second or so,
numbering their reports (``instance``, ``sequence``). :class:`UsageBook` adds a
report's deltas only if its sequence is newer than the last one counted for that
router instance, so a retried report is never counted twice; it hands back the
records to store (the hour's counts of each key and the instance's last sequence),
which the caller stages together: one batch, so the store holds both or neither, and
a restarted control plane (or a new leader) reads back exactly what was counted.

Counts are kept per key per hour (UTC), for :data:`RETENTION`; a key's budget use
this period is the sum of its hours since the period began.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import msgspec

__all__ = [
    "GRANTS",
    "RETENTION",
    "SEEN",
    "USAGE",
    "Counts",
    "UsageBook",
    "instance_key",
    "parse_since",
]

USAGE = "keyusage"
SEEN = "usageseen"
GRANTS = "keygrants"
HOUR = 3600
# Hours kept: a month's budget needs up to 31 days of them.
RETENTION = 40 * 24 * HOUR
# A router instance unseen this long is forgotten (its sequence with it).
SEEN_FOR = 24 * HOUR

Change = tuple[str, str, bytes | None]


@dataclass
class Counts:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors: int = 0
    refused: int = 0
    held_seconds: float = 0.0
    # Wall-clock time of the last report with a request in it (0: none).
    last_used: float = 0.0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def add(self, other: Counts) -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.errors += other.errors
        self.refused += other.refused
        self.held_seconds += other.held_seconds
        self.last_used = max(self.last_used, other.last_used)

    def as_json(self) -> dict[str, float | int]:
        d = dataclasses.asdict(self)
        d["held_seconds"] = round(self.held_seconds, 3)
        return d

    @classmethod
    def clean(
        cls,
        requests: int,
        prompt_tokens: int,
        completion_tokens: int,
        errors: int,
        refused: int,
        held_seconds: float,
        at: float,
    ) -> Counts:
        """From a report's figures: negative or non-finite times count as 0."""
        held = held_seconds if math.isfinite(held_seconds) and held_seconds > 0 else 0.0
        return cls(
            requests, prompt_tokens, completion_tokens, errors, refused, held,
            at if requests else 0.0,
        )  # fmt: skip


def instance_key(instance: str) -> str:
    """A store key for a router's instance (or id) string, whatever characters it holds."""
    return hashlib.sha256(instance.encode()).hexdigest()[:32]


def _hour(at: float) -> int:
    return int(at // HOUR * HOUR)


class _Seen(msgspec.Struct):
    sequence: int
    at: float


class UsageBook:
    def __init__(self) -> None:
        # key name -> hour start (wall seconds) -> counts
        self.hours: dict[str, dict[int, Counts]] = {}
        # instance_key -> (last sequence counted, when)
        self.seen: dict[str, tuple[int, float]] = {}
        # (key name, since) -> tokens used since then (sum of the hours from it on).
        self._sums: dict[tuple[str, int], int] = {}

    def restore(self, usage: Mapping[str, bytes], seen: Mapping[str, bytes]) -> None:
        self.hours.clear()
        self.seen.clear()
        self._sums.clear()
        for key, data in usage.items():
            name, _, hour = key.rpartition("/")
            try:
                counts = msgspec.json.decode(data, type=Counts)
                self.hours.setdefault(name, {})[int(hour)] = counts
            except (msgspec.DecodeError, ValueError):
                continue  # an unreadable hour is skipped, not fatal
        for key, data in seen.items():
            try:
                s = msgspec.json.decode(data, type=_Seen)
            except msgspec.DecodeError:
                continue
            self.seen[key] = (s.sequence, s.at)

    def fresh(self, instance: str, sequence: int) -> bool:
        """Is this report newer than the last one counted from ``instance``?"""
        last = self.seen.get(instance_key(instance))
        return last is None or sequence > last[0]

    def add(
        self, instance: str, sequence: int, usage: Iterable[tuple[str, Counts]], now: float
    ) -> list[Change]:
        """Count one report (nothing if already counted); the records to store, together."""
        if not self.fresh(instance, sequence):
            return []
        ikey = instance_key(instance)
        self.seen[ikey] = (sequence, now)
        changes: list[Change] = [(SEEN, ikey, msgspec.json.encode(_Seen(sequence, now)))]
        hour = _hour(now)
        touched: set[str] = set()
        for name, delta in usage:
            counts = self.hours.setdefault(name, {}).setdefault(hour, Counts())
            counts.add(delta)
            touched.add(name)
            if delta.tokens:
                for (sum_name, since), total in self._sums.items():
                    if sum_name == name and hour >= since:
                        self._sums[(sum_name, since)] = total + delta.tokens
        for name in sorted(touched):
            data = msgspec.json.encode(self.hours[name][hour])
            changes.append((USAGE, f"{name}/{hour}", data))
        return changes

    def tokens_since(self, name: str, since: float) -> int:
        """Tokens ``name`` used in the hours from the one holding ``since`` on."""
        ref = (name, _hour(since))
        total = self._sums.get(ref)
        if total is None:
            total = sum(c.tokens for h, c in self.hours.get(name, {}).items() if h >= ref[1])
            # Only the current periods are asked for; old sums are dropped as they age.
            if len(self._sums) > 10_000:
                self._sums.clear()
            self._sums[ref] = total
        return total

    def totals(self, since: float, names: Iterable[str] | None = None) -> dict[str, Counts]:
        """Each key's counts over the hours from the one holding ``since`` on."""
        start = _hour(since)
        out: dict[str, Counts] = {}
        for name in self.hours if names is None else names:
            total = Counts()
            for h, c in self.hours.get(name, {}).items():
                if h >= start:
                    total.add(c)
            out[name] = total
        return out

    def last_used(self, name: str) -> float:
        return max((c.last_used for c in self.hours.get(name, {}).values()), default=0.0)

    def prune(self, now: float) -> list[Change]:
        """Forget hours past :data:`RETENTION` and instances unseen for a day."""
        changes: list[Change] = []
        oldest = _hour(now - RETENTION)
        for name, hours in self.hours.items():
            for h in [h for h in hours if h < oldest]:
                del hours[h]
                changes.append((USAGE, f"{name}/{h}", None))
        for ikey in [k for k, (_, at) in self.seen.items() if at < now - SEEN_FOR]:
            del self.seen[ikey]
            changes.append((SEEN, ikey, None))
        self._sums = {k: v for k, v in self._sums.items() if k[1] >= oldest}
        return changes


_SINCE = re.compile(r"(\d+(?:\.\d+)?)\s*(s|m|h|d|w)")
_UNIT = {"s": 1, "m": 60, "h": HOUR, "d": 24 * HOUR, "w": 7 * 24 * HOUR}


def parse_since(text: str) -> float:
    """Seconds from ``90m``, ``2h``, ``7d``, ``1w``, ``1d12h``; ValueError naming the flag."""
    rest = text.strip()
    total = 0.0
    while rest:
        match = _SINCE.match(rest)
        if match is None:
            break
        total += float(match.group(1)) * _UNIT[match.group(2)]
        rest = rest[match.end() :].lstrip()
    if rest or not text.strip() or total <= 0:
        raise ValueError(
            f"--since: expected a duration like 30m, 2h, 7d or 1d12h (more than 0), got {text!r}"
        )
    return total
