"""Rolling replacement, pure: which replicas to start and which to drain.

No I/O and no clocks of its own: :func:`rollout_step` takes replica summaries and
returns a step with the words status and ``explain`` show. The reconciler applies it.

Rollout (a changed profile, :attr:`ProfileSpec.revision`): start new replicas while
fewer than ``wanted`` are new and no more than ``wanted + max_surge`` exist; drain an
old one while at least ``wanted - max_unavailable`` stay ready without it; and with
``min_ready``, start none while a new replica has been ready for less than that (the
routers warm each joining replica, and a step's misses stay apart from the next's). A new
replica that fails stops the rollout: nothing more is started or drained, and the old
replicas serve on. A change of the replica count alone is no rollout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ReplicaView", "RolloutStep", "rollout_step"]


@dataclass(frozen=True)
class ReplicaView:
    """What a rollout needs of one replica."""

    replica_id: str
    ready: bool
    placed: bool = True
    # Failed at least once and not ready since: why ("" when fine).
    failing: str = ""
    # Why it is not placed ("" when placed).
    unplaced: str = ""
    ready_since: float = 0.0
    # An old replica whose slot a ready new replica holds (slots.py): its successor
    # is ready, so it is retired before the other ready ones.
    heir_ready: bool = False


@dataclass(frozen=True)
class RolloutStep:
    start: int
    drain: tuple[str, ...]
    # "rolling", "waiting" (for a new replica to get ready or placed) or "stopped".
    state: str
    reason: str = ""
    progress: dict[str, Any] = field(default_factory=dict)


def rollout_step(
    wanted: int,
    new: Sequence[ReplicaView],
    old: Sequence[ReplicaView],
    max_surge: int,
    max_unavailable: int,
    *,
    now: float = 0.0,
    min_ready: float = 0.0,
) -> RolloutStep:
    """One step of replacing ``old`` replicas with ``new`` ones (of the current revision)."""
    failing = next((r for r in new if r.failing), None)
    new_ready = sum(r.ready for r in new)
    progress = {
        "wanted": wanted,
        "updated": len(new),
        "updated_ready": new_ready,
        "old": len(old),
        "max_surge": max_surge,
        "max_unavailable": max_unavailable,
    }
    if failing is not None:
        reason = f"new replica {failing.replica_id} failed: {failing.failing}"
        return RolloutStep(0, (), "stopped", reason, progress)
    total = len(new) + len(old)
    start = max(0, min(wanted - len(new), wanted + max_surge - total))
    settling = next(
        (r for r in new if min_ready > 0 and r.ready and now - r.ready_since < min_ready), None
    )
    if settling is not None:
        start = 0
    ready = new_ready + sum(r.ready for r in old)
    floor = wanted - max_unavailable
    drain: list[str] = []
    # Old replicas that serve nothing go first, then those whose successor (the new
    # replica in their slot) is ready, then the longest ready.
    for r in sorted(old, key=lambda r: (r.ready, not r.heir_ready, r.ready_since, r.replica_id)):
        if r.ready:
            if ready - 1 < floor:
                continue
            ready -= 1
        elif total - 1 < wanted:
            continue  # it may yet serve, and nothing new stands in for it
        drain.append(r.replica_id)
        total -= 1
    waiting_on = next((r for r in new if not r.placed and r.unplaced), None)
    if waiting_on is not None and not drain:
        state, reason = (
            "waiting",
            f"new replica {waiting_on.replica_id} unplaced: {waiting_on.unplaced}",
        )
    elif not drain and not start and settling is not None:
        state = "waiting"
        reason = f"new replica {settling.replica_id} ready for less than min_ready {min_ready:g}s"
    elif not drain and not start:
        state, reason = "waiting", "waiting for new replicas to be ready"
    else:
        state, reason = "rolling", ""
    return RolloutStep(start, tuple(drain), state, reason, progress)
