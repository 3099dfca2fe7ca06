"""Slots, pure: a replica's place within its model/profile, which a replacement inherits.

Routers rank a prefix's endpoints by rendezvous hashing of their slots (issue 28,
Endpoint.slot), not their ids: a replica started by a rolling update or a restart takes
the slot of the one it replaces, so the prefixes that move are exactly the leaving
replica's, to its successor. A replica started to scale up takes the lowest free index.

No I/O: the reconciler gives the slots of the replicas of one model/profile that are not
draining and applies the answers (records.Replica.slot, persisted with the replica).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["fill_slots", "lowest_free", "next_slot", "slot_name"]

NONE = -1


def slot_name(model: str, profile: str, index: int) -> str:
    """Endpoint.slot for ``index`` (``""`` where not assigned)."""
    return f"{model}/{profile}/{index}" if index >= 0 else ""


def lowest_free(taken: Iterable[int]) -> int:
    used = set(taken)
    i = 0
    while i in used:
        i += 1
    return i


def fill_slots(slots: Sequence[int]) -> list[int]:
    """``slots`` with each unassigned one (``NONE``: adopted, or stored before slots
    existed) given the lowest free index, in order; assigned ones are kept."""
    out = list(slots)
    for i, s in enumerate(out):
        if s < 0:
            out[i] = lowest_free(out)
    return out


def next_slot(new: Sequence[int], old: Sequence[int], wanted: int) -> int:
    """The slot of a replica started now.

    ``new``: the slots of the current revision's replicas (not draining); ``old``: those
    of the replicas a rollout will retire (not draining yet), in the order it retires
    them; ``wanted``: the replica count. An index below ``wanted`` that none of them
    holds comes first (a drained replica's, or a scale-up's); then a replacement takes
    the first old slot no new replica holds yet (the rollout retires that one once it
    is ready: see rollout.ReplicaView.heir_ready); otherwise the lowest free index.
    """
    claimed = set(new)
    taken = claimed | set(old)
    for i in range(wanted):
        if i not in taken:
            return i
    for s in old:
        if s >= 0 and s not in claimed:
            return s
    return lowest_free(taken)
