"""A drain that keeps the cache warm (issue 28 point 3): when a replica llmgw takes away
begins to drain (pure).

When the control plane retires a serving replica (scale-down, a rolling update's
replacement, a node drain, a restart) it first publishes it ``leaving``
(``Endpoint.leaving``) for ``warm_before_drain`` seconds: routers send it no new request
and warm the replicas that inherit its hot prefixes. Only then is it sent ``DrainShard``,
with the whole ``drain_timeout`` still ahead of it. A replica that serves nothing yet (not
ready) has nothing to hand over and drains at once.
"""

from __future__ import annotations

__all__ = ["leave_times", "publishes_leaving"]


def leave_times(
    now: float, warm_before_drain: float, drain_timeout: float, serving: bool
) -> tuple[float, float]:
    """``(leave_at, drain_deadline)`` for a replica retired at ``now``: its drain starts at
    ``leave_at`` (``now`` plus the warning when it serves, else ``now``) and ends at the
    latest ``drain_timeout`` after that."""
    warn = max(0.0, warm_before_drain) if serving else 0.0
    leave_at = now + warn
    return leave_at, leave_at + max(0.0, drain_timeout)


def publishes_leaving(draining: bool, leave_at: float, now: float) -> bool:
    """Whether a replica is still published, marked leaving: retired, its drain not begun."""
    return draining and leave_at > now
