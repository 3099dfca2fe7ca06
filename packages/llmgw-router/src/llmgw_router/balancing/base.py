"""What every balancer shares: the candidates it sees, its pick and why, its interface.

Pure: a balancer sees the candidates, a predicate that says which are usable now, an
optional session key, the request's prompt prefix blocks (see prefix.py) and the time of
the choice (it never reads the clock). It never returns an unusable endpoint; it returns
None only when no candidate is usable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

__all__ = ["REASONS", "Balancer", "C", "Candidate", "L", "LoadedCandidate", "Pick"]


class Candidate(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def weight(self) -> int: ...
    @property
    def outstanding(self) -> int: ...


C = TypeVar("C", bound=Candidate)


# Why a balancer chose what it chose (Pick.reason), each counted in
# llmgw_router_picks_total{reason} and named in the request's log line.
REASONS = (
    # cache_aware, a prompt with a prefix:
    "holder",  # an endpoint this router sent the prefix to (the longest match)
    "engine_cache",  # the engine that reports the prompt's blocks cached (precise)
    "rendezvous",  # a new prefix's home: its first rendezvous choice
    "capacity",  # a new prefix's home: the first rendezvous choice with room in its cache
    "balance",  # a new prefix's home: the first rendezvous choice under its share of prefixes
    "home_again",  # a spilled prefix back at its home
    "predicted_ttft",  # another endpoint's predicted time to first token was lower
    "hot_spread",  # a hot prefix spread over its rendezvous choices, least loaded first
    "bound_holder",  # over the bound: the least loaded holder within it
    "bound_spill",  # over the bound: the next of the ranking within it
    "bound_least_loaded",  # every endpoint over the bound: the least loaded
    "distinct",  # prompts that share nothing: the fewest awaiting a first token
    # any balancer:
    "least_loaded",  # no prefix (or least_outstanding): the least loaded
    "only",  # one usable candidate
    "round_robin",
    "session",  # session_affinity: the key's rendezvous owner
    "none",  # no candidate usable
)


@dataclass(frozen=True, slots=True)
class Pick(Generic[C]):
    """A balancer's choice and why (one of :data:`REASONS`). ``miss``: cache_aware's
    estimate of the prompt's prefix blocks the chosen engine does not hold (what it
    must prefill), 0 where not estimated."""

    endpoint: C | None
    reason: str
    miss: int = 0


class Balancer(Generic[C]):
    """``cached``, with precise matching: per candidate, how many leading token blocks of
    the request's prompt its engine reports cached, -1 where the engine reports none.
    ``at``: the time of the choice (``time.monotonic()``'s clock), what the candidates'
    time-dependent figures are read at; a balancer never reads the clock itself."""

    def choose(
        self,
        candidates: Sequence[C],
        usable: Callable[[C], bool],
        key: str | None,
        prefix: Sequence[int] = (),
        cached: Callable[[C], int] | None = None,
        *,
        at: float,
    ) -> Pick[C]:
        raise NotImplementedError

    def pick(
        self,
        candidates: Sequence[C],
        usable: Callable[[C], bool],
        key: str | None,
        prefix: Sequence[int] = (),
        cached: Callable[[C], int] | None = None,
        *,
        at: float,
    ) -> C | None:
        return self.choose(candidates, usable, key, prefix, cached, at=at).endpoint

    def forget(self, endpoint_id: str) -> None:
        """The engine behind ``endpoint_id`` changed: drop what was learnt about it."""

    def remembered(self, endpoint_id: str) -> int:
        """How many prefix blocks this balancer remembers sending to ``endpoint_id``."""
        return 0


class LoadedCandidate(Candidate, Protocol):
    def load_at(self, now: float) -> float:
        """The load the balancer weighs, at time ``now``."""
        ...

    @property
    def awaiting_first(self) -> int: ...
    @property
    def generation(self) -> int: ...
    @property
    def cache_blocks(self) -> int:
        """The engine's prefix cache, in prefix blocks; 0 when not known."""
        ...

    def pending_at(self, now: float) -> float:
        """Prefix blocks queued for prefill ahead of a new request there, at time ``now``."""
        ...

    @property
    def block_time(self) -> float:
        """Seconds the engine takes to prefill one prefix block (learned); 0: not known."""
        ...

    @property
    def slot(self) -> str:
        """Its place within its model/profile, "" where none: cache_aware ranks by it
        where set (a replacement in the slot inherits its predecessor's prefixes)."""
        ...


L = TypeVar("L", bound=LoadedCandidate)
