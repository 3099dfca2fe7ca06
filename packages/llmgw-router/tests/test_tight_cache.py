"""cache_aware when caches are tight: capacity-aware placement, predicted time to first
token, and every pick's reason. Hypothesis properties and examples."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_router.balancing import (
    REASONS,
    CacheAware,
    LeastOutstanding,
    Pick,
    RoundRobin,
    SessionAffinity,
)
from llmgw_router.endpoints import Endpoint, EndpointSpec, EngineLoad
from llmgw_testkit.candidates import Cand, usable


def tenant(t: int, blocks: int, tail: int = 0) -> tuple[int, ...]:
    """A tenant's prompt as prefix blocks: its own chained hashes, then a unique tail."""
    head = tuple((t + 1) * 1_000_003 + i for i in range(blocks))
    return head + tuple(-(t + 1) * 1_000_003 - 7 * tail - i for i in range(1 if tail else 0))


# ----- capacity-aware placement -------------------------------------------------------------


# The shared rule's own properties (homes within the caches, the same for the same
# prefixes whatever the order) are in test_placement.py.


@pytest.mark.parametrize("shared_homes", [False, True])
def test_tenants_fill_engines_to_their_caches_not_by_hashing(shared_homes: bool) -> None:
    """Eight tenants over four engines that each hold two: two each, where rendezvous
    hashing alone puts them unevenly; each stays at its home after. (With shared_homes:
    the rule's homes; without, first come first placed: either way two each.)"""
    size = 50
    cands = [Cand(f"e{i}", cache_blocks=2 * (size + 2) * 8 // 7 + 2) for i in range(4)]
    plain = CacheAware[Cand](window=10_000)
    spread = Counter(plain.ranking(cands, tenant(t, size))[0].id for t in range(8))
    assert max(spread.values()) > 2  # what hashing alone would do
    balancer = CacheAware[Cand](window=10_000, shared_homes=shared_homes)
    for k in (1, 2):
        for t in range(8):
            pick = balancer.choose(cands, usable, None, tenant(t, size, tail=k), at=0.0)
            assert pick.endpoint is not None
    homes = {}
    for t in range(8):
        pick = balancer.choose(cands, usable, None, tenant(t, size, tail=3), at=0.0)
        assert pick.endpoint is not None
        homes[t] = pick.endpoint.id
    assert sorted(Counter(homes.values()).values()) == [2, 2, 2, 2]
    for k in range(4, 8):
        for t in range(8):
            pick = balancer.choose(cands, usable, None, tenant(t, size, tail=k), at=0.0)
            assert pick.endpoint is not None
            assert (pick.endpoint.id, pick.reason) == (homes[t], "holder")
            assert pick.miss == 1  # the unique tail only


def test_what_no_longer_fits_is_no_longer_counted_as_held() -> None:
    """The router's memory of an engine is as large as its cache: a prefix pushed out by
    others sent there since is a miss again."""
    size = 30
    cands = [Cand("only", cache_blocks=2 * size)]
    balancer = CacheAware[Cand]()
    balancer.choose(cands, usable, None, tenant(0, size), at=0.0)
    assert balancer.matched(cands[0], tenant(0, size)) == size
    balancer.choose(cands, usable, None, tenant(1, size), at=0.0)
    balancer.choose(cands, usable, None, tenant(2, size), at=0.0)
    assert balancer.matched(cands[0], tenant(0, size)) == 0
    assert balancer.choose(cands, usable, None, tenant(0, size), at=0.0).miss == size


# ----- predicted time to first token --------------------------------------------------------


def test_a_holder_keeps_its_prefix_until_its_queue_costs_more_than_moving() -> None:
    """Moving costs the prompt's prefill there, and as much again to what comes after it
    there: the holder's queue must be longer than both."""
    size = 60
    cands = [Cand(f"e{i}") for i in range(4)]
    balancer = CacheAware[Cand](slack=100.0)
    for t in range(6):  # others, so the tenant is not hot
        balancer.choose(cands, usable, None, tenant(100 + t, size), at=0.0)
    first = balancer.choose(cands, usable, None, tenant(0, size, tail=1), at=0.0)
    home = first.endpoint
    assert home is not None
    # Queued there: less than two prefills of the prompt more than elsewhere: it stays.
    home.pending = 2 * size - 1.0
    pick = balancer.choose(cands, usable, None, tenant(0, size, tail=2), at=0.0)
    assert (pick.endpoint, pick.reason) == (home, "holder")
    # More than that: the least queued other takes it.
    home.pending = 2 * size + 5.0
    pick = balancer.choose(cands, usable, None, tenant(0, size, tail=3), at=0.0)
    assert pick.endpoint is not home
    assert pick.reason == "predicted_ttft"
    assert pick.miss == size + 1


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0, 500), st.floats(0.001, 0.05)), min_size=2, max_size=6),
    st.integers(2, 100),
)
def test_a_new_prefix_goes_where_the_rules_say_whatever_the_queues(
    queues: list[tuple[float, float]], size: int
) -> None:
    """A new prefix is never placed by this router's queues (every router places it
    alike): its first rendezvous choice, all caches unknown."""
    cands = [Cand(f"e{i}", pending=p, block_time=t) for i, (p, t) in enumerate(queues)]
    balancer = CacheAware[Cand](slack=1000.0)
    prompt = tenant(0, size)
    rule = balancer.ranking(cands, prompt)[0]
    pick = balancer.choose(cands, usable, None, prompt, at=0.0)
    assert (pick.endpoint, pick.reason) == (rule, "rendezvous")


# ----- reasons ------------------------------------------------------------------------------


def test_every_pick_says_why() -> None:
    cands = [Cand(f"e{i}") for i in range(4)]
    ca = CacheAware[Cand]()
    assert ca.choose(cands, lambda c: False, None, (1, 2), at=0.0) == Pick(None, "none")
    assert ca.choose(cands[:1], usable, None, (1, 2), at=0.0).reason == "only"
    assert ca.choose(cands, usable, None, (), at=0.0).reason == "least_loaded"
    for t in range(8):
        ca.choose(cands, usable, None, tenant(t, 20), at=0.0)
    assert ca.choose(cands, usable, None, tenant(0, 20, tail=1), at=0.0).reason == "holder"
    home = ca.ranking(cands, tenant(9, 20))[0]
    home.load = 50.0  # over the bound
    spilled = ca.choose(cands, usable, None, tenant(9, 20), at=0.0)
    assert (spilled.reason, spilled.endpoint is not home) == ("bound_spill", True)
    hot = CacheAware[Cand](window=16)
    reasons = {
        hot.choose(cands, usable, None, tenant(1, 20, tail=k), at=0.0).reason for k in range(20)
    }
    assert "hot_spread" in reasons
    assert RoundRobin[Cand]().choose(cands, usable, None, at=0.0).reason == "round_robin"
    assert LeastOutstanding[Cand]().choose(cands, usable, None, at=0.0).reason == "least_loaded"
    assert SessionAffinity[Cand]().choose(cands, usable, "k", at=0.0).reason == "session"
    assert SessionAffinity[Cand]().choose(cands, usable, None, at=0.0).reason == "least_loaded"


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 12), min_size=1, max_size=40),
    st.lists(st.floats(0, 20), min_size=1, max_size=6),
    st.integers(0, 400),
)
def test_every_reason_is_a_known_one_and_the_miss_is_within_the_prompt(
    arrivals: list[int], loads: list[float], capacity: int
) -> None:
    cands = [Cand(f"e{i}", load=load, cache_blocks=capacity) for i, load in enumerate(loads)]
    balancer = CacheAware[Cand](window=8)
    for k, t in enumerate(arrivals):
        prompt = tenant(t, 10 + t, tail=k + 1)
        pick = balancer.choose(cands, usable, None, prompt, at=0.0)
        assert pick.reason in REASONS
        assert 0 <= pick.miss <= len(prompt)


# ----- what the endpoints tell the balancer -------------------------------------------------


def test_an_endpoints_cache_from_its_report_else_its_config() -> None:
    ep = Endpoint(spec=EndpointSpec("e", "http://x", ("m",), cache_tokens=6400))
    assert ep.cache_blocks == math.floor(6400 / Endpoint.tokens_per_block)
    ep.report(EngineLoad(running=1, cache_tokens=12800, measured_at=1e12))
    assert ep.cache_tokens == 12800
    ep.report(EngineLoad(running=1, measured_at=1e12))
    assert ep.cache_tokens == 6400
    assert Endpoint(spec=EndpointSpec("f", "http://y", ("m",))).cache_blocks == 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 80), st.floats(0.01, 2.0)), min_size=1, max_size=30))
def test_pending_prefill_returns_to_zero_and_the_rate_is_learnt(
    requests: list[tuple[int, float]],
) -> None:
    ep = Endpoint(spec=EndpointSpec("e", "http://x", ("m",)))
    open_ = []
    for miss, seconds in requests:
        open_.append((miss, ep.begin_prefill(miss), seconds))
    assert ep.pending_blocks == sum(m for m, _, _ in open_)
    rng = random.Random(0)
    rng.shuffle(open_)
    for miss, work, seconds in open_:
        ep.end_prefill(miss, work, seconds)
    assert ep.pending_blocks == 0
    learnt = [s / w for _, w, s in open_ if w >= 8]
    if learnt:
        assert min(learnt) <= ep.block_time <= max(learnt)
    else:
        assert ep.block_time == 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 30), st.floats(0, 300), st.integers(0, 300), st.integers(1, 3)),
        min_size=2,
        max_size=6,
    ),
    st.lists(st.integers(0, 10), min_size=1, max_size=30),
    st.sampled_from([0.0, 0.25, 1.0]),
    st.sampled_from([0.0, 3.0]),
)
def test_the_bound_holds_whatever_the_queues_and_caches(
    shape: list[tuple[int, float, int, int]],
    arrivals: list[int],
    epsilon: float,
    slack: float,
) -> None:
    """Predicted times and capacity never take a pick over the bounded-load rule's bound
    (unless every endpoint is over it: then the least loaded)."""
    cands = [
        Cand(f"e{i}", load=float(load), pending=pending, cache_blocks=cap, weight=w)
        for i, (load, pending, cap, w) in enumerate(shape)
    ]
    balancer = CacheAware[Cand](epsilon=epsilon, slack=slack, window=8)
    for k, t in enumerate(arrivals):
        pick = balancer.choose(cands, usable, None, tenant(t, 12, tail=k + 1), at=0.0)
        chosen = pick.endpoint
        assert chosen is not None
        total = sum(c.load for c in cands)
        weights = sum(c.weight for c in cands)
        within = balancer.within(chosen.load, total, chosen.weight, weights, len(cands))
        least = min(c.load / c.weight for c in cands)
        assert within or chosen.load / chosen.weight == least, pick.reason
        chosen.load += 1
