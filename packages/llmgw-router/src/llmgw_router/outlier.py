"""Passive outlier ejection, as pure functions of the failures requests see.

`consecutive_failures` failures in a row eject an endpoint for
``base_time * 2**(ejections so far)``, capped at ``max_time``: an endpoint that
keeps failing is tried less and less often. A long enough clean run forgets the
history.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["OutlierPolicy", "OutlierState", "ejection_time", "record_failure", "record_success"]


@dataclass(frozen=True, slots=True)
class OutlierPolicy:
    consecutive_failures: int = 3
    base_time: float = 5.0
    max_time: float = 300.0


@dataclass(frozen=True, slots=True)
class OutlierState:
    consecutive_failures: int = 0
    ejections: int = 0
    ejected_until: float = 0.0
    last_ejected_at: float = 0.0


def ejection_time(policy: OutlierPolicy, ejections: int) -> float:
    """How long the ``ejections``-th ejection (1-based) lasts."""
    if ejections >= 64:
        return policy.max_time
    return min(policy.max_time, policy.base_time * float(2 ** max(0, ejections - 1)))


def record_success(state: OutlierState, now: float, policy: OutlierPolicy) -> OutlierState:
    # Healthy for twice the longest ejection since the last one: start over.
    forget = state.ejections > 0 and now - state.last_ejected_at >= 2 * policy.max_time
    if state.consecutive_failures == 0 and not forget:
        return state
    return replace(state, consecutive_failures=0, ejections=0 if forget else state.ejections)


def record_failure(state: OutlierState, now: float, policy: OutlierPolicy) -> OutlierState:
    """The state after one failure; ``ejected_until > now`` when this one ejects it."""
    if state.ejected_until > now:
        # Already out: requests that were in flight when it was ejected do not extend it.
        return state
    failures = state.consecutive_failures + 1
    if failures < policy.consecutive_failures:
        return replace(state, consecutive_failures=failures)
    ejections = state.ejections + 1
    return OutlierState(
        consecutive_failures=0,
        ejections=ejections,
        ejected_until=now + ejection_time(policy, ejections),
        last_ejected_at=now,
    )
