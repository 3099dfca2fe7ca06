"""Which replica loads or unloads which LoRA adapter: the pure decision (issue 30).

Input: each replica of a base model (its load, how many adapters its engine holds at
once, which it holds and which it is loading now) and each adapter's demand (requests
held at routers for want of a holder, its recent request rate, when it was last used).
Output: load and unload actions, in the order to send them.

- An adapter with requests held and no holder (nor a load under way) is loaded at once
  on the least loaded replica with a free slot; when every replica is full, the one
  whose least used adapter is the least used of all unloads it first (fleet-wide: the
  lowest recent request rate, then the least recently used; never an adapter being
  loaded, with requests held, or used within ``min_idle`` seconds).
- With ``spare`` set, the fleet's least used adapters are the spare pool (``spare`` of
  them, more while the adapters left out ask for more turns than that many slots give,
  each turn ``turn`` seconds: :func:`pool_size`): a newcomer evicts only one of those or
  one with a lower rate than its own; for each ``patience`` seconds its requests have
  waited, the pool it may evict from takes in the next least used adapter, so it is
  served in the end without the most used going first. The hot adapters stay
  pinned while rarely used ones take turns in the spare slots: without it, a burst of
  tail requests, whose adapters once loaded are kept for ``min_idle``, unloaded the
  adapters asked for every few seconds (bench_lora's trace; issue 30); and when a burst
  outlasted ``patience`` and any idle adapter could go, the third and fourth most used
  went (bench_lora seed 3's trace).
- A hot adapter (more than ``hot_rate`` requests a second per holder) gains a holder,
  one per pass, on the least loaded replica that does not hold it, evicting there only
  an adapter used less recently than it.
- Nothing else moves: an idle adapter stays loaded until its slot is wanted (LRU).

The result never puts more adapters on a replica than it holds at once, never loads an
adapter on a replica that holds it, and never unloads one that is being loaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["Action", "Demand", "ReplicaView", "plan", "pool_size"]


@dataclass(frozen=True)
class ReplicaView:
    """One replica of the base model, as the control plane sees it now."""

    id: str
    # Requests running and waiting at its engine (its last load report).
    load: float
    # Adapters its engine holds at once (the profile's lora.max_loras).
    capacity: int
    held: frozenset[str] = frozenset()
    # Loads sent and not yet seen in a load report: they take a slot already.
    loading: frozenset[str] = frozenset()

    @property
    def taken(self) -> frozenset[str]:
        return self.held | self.loading


@dataclass(frozen=True)
class Demand:
    """What routers said of one adapter."""

    # Requests held at routers now (no holder to send them to).
    held: int = 0
    # Requests a second, recently.
    rate: float = 0.0
    # When it was last asked for (monotonic seconds; 0: never).
    last_used: float = 0.0
    # How long requests have been held for it without a break (seconds).
    held_for: float = 0.0


def pool_size(slots: int, rates: Iterable[float], spare: int, turn: float) -> int:
    """How many slots the spare pool has: at least ``spare``, and as many more (up to all)
    as the demand for the adapters left out of the pinned ones needs, each taking a spare
    slot for ``turn`` seconds (a load and ``min_idle``): the smallest ``n`` whose
    left-out rate times ``turn`` is at most ``n``."""
    ordered = sorted(rates, reverse=True)
    n = min(spare, slots)
    while n < slots and sum(ordered[slots - n :]) * turn > n:
        n += 1
    return n


@dataclass(frozen=True)
class Action:
    kind: Literal["load", "unload"]
    replica: str
    adapter: str


@dataclass
class _Replica:
    view: ReplicaView
    taken: set[str] = field(default_factory=set)
    load: float = 0.0


def plan(
    replicas: Iterable[ReplicaView],
    demand: Mapping[str, Demand],
    *,
    hot_rate: float = 8.0,
    now: float = 0.0,
    min_idle: float = 0.0,
    patience: float = 0.0,
    spare: int | None = None,
    turn: float = 0.0,
) -> list[Action]:
    """The loads and unloads to send now (see the module's rules)."""
    reps = [_Replica(r, set(r.taken), r.load) for r in replicas if r.capacity > 0]
    if not reps:
        return []
    if spare is not None:
        slots = sum(r.view.capacity for r in reps)
        spare = pool_size(slots, [d.rate for d in demand.values()], spare, turn)
    actions: list[Action] = []

    def last_used(adapter: str) -> float:
        d = demand.get(adapter)
        return d.last_used if d is not None else 0.0

    def used(adapter: str) -> tuple[float, float]:
        """How much an adapter is in use: its recent rate, then when last used."""
        d = demand.get(adapter)
        return (d.rate, d.last_used) if d is not None else (0.0, 0.0)

    def everyone() -> set[str]:
        return {a for r in reps for a in r.taken}

    def victim(rep: _Replica, adapter: str, newer_than: float | None) -> str | None:
        """The adapter ``rep`` may unload for ``adapter``: the least used first, and with
        ``spare`` set only one of the spare pool (widened by the next least used for each
        ``patience`` that ``adapter``'s requests have waited) or used less than
        ``adapter`` (rate)."""
        wanted = demand.get(adapter, Demand())
        pool: set[str] | None = None
        if spare is not None and patience > 0:
            widen = int(wanted.held_for // patience)
            pool = set(sorted(everyone(), key=lambda a: (used(a), a))[: spare + widen])
        movable = [
            a
            for a in rep.taken
            if a not in rep.view.loading
            and demand.get(a, Demand()).held == 0
            and (min_idle <= 0 or now - last_used(a) >= min_idle)
            and (pool is None or a in pool or used(a)[0] < wanted.rate)
        ]
        if not movable:
            return None
        oldest = min(movable, key=lambda a: (used(a), a))
        if newer_than is not None and last_used(oldest) >= newer_than:
            return None
        return oldest

    def place(adapter: str, among: list[_Replica], newer_than: float | None) -> bool:
        # A free slot on the least loaded replica; else, all full, the replica whose
        # least recently used adapter is the least recently used of all (LRU fleet-wide).
        free = [r for r in among if len(r.taken) < r.view.capacity]
        if free:
            rep = min(free, key=lambda r: (r.load, len(r.taken), r.view.id))
        else:
            outs = [(out, r) for r in among if (out := victim(r, adapter, newer_than)) is not None]
            if not outs:
                return False
            out, rep = min(outs, key=lambda o: (used(o[0]), o[1].load, o[1].view.id))
            rep.taken.discard(out)
            actions.append(Action("unload", rep.view.id, out))
        rep.taken.add(adapter)
        # What it adds to the replica's load, so the next placement spreads.
        rep.load += 1.0
        actions.append(Action("load", rep.view.id, adapter))
        return True

    def holders(adapter: str) -> list[_Replica]:
        return [r for r in reps if adapter in r.taken]

    # 1. Requests held and no holder: load at once, most held first.
    waiting = sorted(
        (a for a, d in demand.items() if d.held > 0 and not holders(a)),
        key=lambda a: (-demand[a].held, a),
    )
    for adapter in waiting:
        place(adapter, reps, None)
    # 2. Hot adapters gain a holder each (one per pass), hottest per holder first.
    hot = sorted(
        (
            (d.rate / len(h), a)
            for a, d in demand.items()
            if (h := holders(a)) and d.rate / len(h) > hot_rate
        ),
        reverse=True,
    )
    for _, adapter in hot:
        others = [r for r in reps if adapter not in r.taken]
        if others:
            place(adapter, others, last_used(adapter))
    return actions
