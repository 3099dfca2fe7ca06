"""The retry decision, apart from I/O: after a failed attempt, try again, and where.

A failure before the first byte reached the client may be retried on another
endpoint. :func:`after_failure` says whether to (retry count, deadline, 429 policy,
budget, in that order: the budget is only spent on a retry that will happen), and
:func:`retry_tiers` says where: the candidate lists the balancer tries in turn.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

__all__ = ["RetryPolicy", "Verdict", "after_failure", "retry_tiers"]


class Verdict(enum.Enum):
    RETRY = "retry"
    RETRIES_SPENT = "retries_spent"
    DEADLINE = "deadline"
    NO_RETRY_ON_429 = "no_retry_on_429"
    BUDGET = "budget"


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_retries: int = 2
    retry_on_429: bool = True


def after_failure(
    policy: RetryPolicy,
    *,
    retries: int,
    reason: str,
    now: float,
    deadline: float,
    spend: Callable[[float], bool],
) -> Verdict:
    """What to do after an attempt failed with ``reason`` (``retries`` made so far).

    ``spend(now)`` takes a token from the retry budget; it is called only when every
    other check allows the retry.
    """
    if retries >= policy.max_retries:
        return Verdict.RETRIES_SPENT
    if now >= deadline:
        return Verdict.DEADLINE
    if reason == "status_429" and not policy.retry_on_429:
        return Verdict.NO_RETRY_ON_429
    if not spend(now):
        return Verdict.BUDGET
    return Verdict.RETRY


class _Choice(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def profile(self) -> str: ...


E = TypeVar("E", bound=_Choice)


def retry_tiers(
    first: Sequence[E], current: Sequence[E], tried: Sequence[str], refused: Collection[str]
) -> list[list[E]]:
    """Where a retry may go, best first: the balancer picks from the first tier it can.

    From the current endpoints (a snapshot may have come since the first pick), in the
    profiles of the first choice when any is left there: first those not tried yet, then
    any but the one that just failed and those that refused a connection.
    """
    profiles = {ep.profile for ep in first}
    pool = [ep for ep in current if ep.profile in profiles] or list(current)
    seen = set(tried)
    fresh = [ep for ep in pool if ep.id not in seen]
    skip = {tried[-1], *refused} if tried else set(refused)
    again = [ep for ep in pool if ep.id not in skip]
    return [fresh, again]
