"""Balancers: properties over any candidate set, plus a few worked examples."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_router.balancing import (
    Balancer,
    LeastOutstanding,
    RoundRobin,
    SessionAffinity,
    make_balancer,
    rendezvous_owner,
)


@dataclass
class Cand:
    id: str
    weight: int = 1
    outstanding: int = 0
    up: bool = True


def usable(c: Cand) -> bool:
    return c.up


candidates = st.lists(
    st.builds(
        Cand,
        id=st.text(alphabet="abcdefgh", min_size=1, max_size=4),
        weight=st.integers(1, 10),
        outstanding=st.integers(0, 50),
        up=st.booleans(),
    ),
    max_size=8,
    unique_by=lambda c: c.id,
)
names = st.sampled_from(["least_outstanding", "round_robin", "session_affinity"])


@given(candidates, names, st.one_of(st.none(), st.text(max_size=8)), st.integers(0, 2**32))
def test_never_picks_an_unusable_endpoint(
    cands: list[Cand], name: str, key: str | None, seed: int
) -> None:
    balancer: Balancer[Cand] = make_balancer(name, random.Random(seed))
    picked = balancer.pick(cands, usable, key, at=0.0)
    if any(c.up for c in cands):
        assert picked is not None
        assert picked.up
        assert picked in cands
    else:
        assert picked is None


@given(candidates, st.integers(0, 2**32))
def test_least_outstanding_never_picks_the_unique_busiest(cands: list[Cand], seed: int) -> None:
    ready = [c for c in cands if c.up]
    picked = LeastOutstanding[Cand](random.Random(seed)).pick(cands, usable, None, at=0.0)
    if len(ready) < 2:
        return
    loads = sorted((c.outstanding / c.weight, c.id) for c in ready)
    worst_load, worst_id = loads[-1]
    if loads[-2][0] < worst_load:
        assert picked is not None
        assert picked.id != worst_id


@given(st.integers(1, 8), st.integers(1, 5))
def test_round_robin_is_exactly_fair(n: int, rounds: int) -> None:
    cands = [Cand(id=f"e{i}") for i in range(n)]
    balancer = RoundRobin[Cand]()
    picks = Counter(balancer.pick(cands, usable, None, at=0.0).id for _ in range(n * rounds))  # type: ignore[union-attr]
    assert picks == {c.id: rounds for c in cands}


@settings(max_examples=50)
@given(candidates, st.text(min_size=1, max_size=12))
def test_affinity_is_stable_and_consistent(cands: list[Cand], key: str) -> None:
    for c in cands:
        c.up = True
    owner = rendezvous_owner(cands, key)
    balancer = SessionAffinity[Cand](random.Random(0))
    assert balancer.pick(cands, usable, key, at=0.0) is owner
    assert balancer.pick(list(reversed(cands)), usable, key, at=0.0) is owner
    # Removing another endpoint does not move the key: that is the consistency.
    if owner is not None and len(cands) > 1:
        other = next(c for c in cands if c is not owner)
        assert rendezvous_owner([c for c in cands if c is not other], key) is owner


def test_affinity_falls_back_when_its_endpoint_is_unusable() -> None:
    cands = [Cand(id=f"e{i}") for i in range(4)]
    owner = rendezvous_owner(cands, "session-1")
    assert owner is not None
    owner.up = False
    picked = SessionAffinity[Cand](random.Random(1)).pick(cands, usable, "session-1", at=0.0)
    assert picked is not None
    assert picked is not owner


def test_least_outstanding_prefers_lighter_load() -> None:
    a, b = Cand("a", outstanding=10), Cand("b", outstanding=0)
    balancer = LeastOutstanding[Cand](random.Random(7))
    assert all(balancer.pick([a, b], usable, None, at=0.0) is b for _ in range(100))


def test_weights_shape_the_share_at_equal_load() -> None:
    # Idle endpoints: each pick goes to the first weighted draw, so share follows weight.
    cands = [Cand("light", weight=1), Cand("heavy", weight=3)]
    balancer = LeastOutstanding[Cand](random.Random(42))
    picks = Counter(balancer.pick(cands, usable, None, at=0.0).id for _ in range(4000))  # type: ignore[union-attr]
    assert 0.68 < picks["heavy"] / 4000 < 0.82


def test_least_outstanding_spreads_evenly_over_equal_endpoints() -> None:
    cands = [Cand(f"e{i}") for i in range(4)]
    balancer = LeastOutstanding[Cand](random.Random(3))
    picks = Counter(balancer.pick(cands, usable, None, at=0.0).id for _ in range(4000))  # type: ignore[union-attr]
    assert all(800 < picks[c.id] < 1200 for c in cands)


def test_unknown_balancer_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown balancer"):
        make_balancer("fastest")
