"""Passive outlier ejection, as pure functions of the failures requests see.

`consecutive_failures` failures in a row eject an endpoint for
``base_time * 2**(ejections so far)``, capped at ``max_time``: an endpoint that
keeps failing is tried less and less often. A long enough clean run forgets the
history.

Two guards, after envoy's: at most `max_ejection_percent` of a model's endpoints are
ejected at once (one may always be), and when fewer than `panic_threshold` percent of
them are usable the balancer sees them all again, ejected or not (panic): a brownout
that makes every replica look broken degrades the service instead of turning it off.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = [
    "OutlierPolicy",
    "OutlierState",
    "ejection_time",
    "in_panic",
    "may_eject",
    "record_failure",
    "record_success",
]


@dataclass(frozen=True, slots=True)
class OutlierPolicy:
    consecutive_failures: int = 3
    base_time: float = 5.0
    max_time: float = 300.0
    max_ejection_percent: float = 50.0
    panic_threshold: float = 50.0


def may_eject(ejected: int, total: int, policy: OutlierPolicy) -> bool:
    """Whether one more of ``total`` endpoints may go out while ``ejected`` already are.

    One may always be ejected, as in envoy, so that a model with a single replica still
    backs off from it (and panic mode serves it anyway).
    """
    if ejected == 0:
        return True
    return (ejected + 1) * 100 <= policy.max_ejection_percent * total


def in_panic(usable: int, total: int, policy: OutlierPolicy) -> bool:
    """Too few usable endpoints: balance over all of them, ejection ignored."""
    return total > 0 and usable * 100 < policy.panic_threshold * total


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


def record_failure(
    state: OutlierState, now: float, policy: OutlierPolicy, *, allowed: bool = True
) -> OutlierState:
    """The state after one failure; ``ejected_until > now`` when this one ejects it.

    ``allowed`` False (the model's ejection cap is reached) keeps counting the failures
    without ejecting; the next failure after room frees up ejects.
    """
    if state.ejected_until > now:
        # Already out: requests that were in flight when it was ejected do not extend it.
        return state
    failures = state.consecutive_failures + 1
    if failures < policy.consecutive_failures or not allowed:
        return replace(state, consecutive_failures=min(failures, policy.consecutive_failures))
    ejections = state.ejections + 1
    return OutlierState(
        consecutive_failures=0,
        ejections=ejections,
        ejected_until=now + ejection_time(policy, ejections),
        last_ejected_at=now,
    )
