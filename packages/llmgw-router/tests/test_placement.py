"""cache_aware's shared placement rule (balancing.placement): several routers that saw
the same prefixes give each the same home, within the engines' caches. Hypothesis
properties and examples."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_router.balancing import CacheAware
from llmgw_router.balancing.placement import place
from llmgw_testkit.candidates import Cand, usable


def tenant(t: int, blocks: int, tail: int = 0) -> tuple[int, ...]:
    """A tenant's prompt as prefix blocks: its own chained hashes, then a unique tail."""
    head = tuple((t + 1) * 1_000_003 + i for i in range(blocks))
    return head + tuple(-(t + 1) * 1_000_003 - 7 * tail - i for i in range(1 if tail else 0))


def ranks_for(keys: list[int], n: int) -> dict[int, list[tuple[int, float]]]:
    """Each key's endpoints in a pseudo-random order, scored."""
    out = {}
    for key in keys:
        rng = random.Random(key)
        scores = [(rng.random(), i) for i in range(n)]
        scores.sort(reverse=True)
        out[key] = [(i, s) for s, i in scores]
    return out


prefixes = st.dictionaries(st.integers(0, 10**6), st.integers(1, 60), min_size=1, max_size=40)
capacities = st.lists(st.integers(0, 300), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(prefixes, capacities, st.randoms(use_true_random=False))
def test_the_homes_do_not_depend_on_the_order_prefixes_were_seen(
    sizes: dict[int, int], caps: list[int], rng: random.Random
) -> None:
    """What lets routers agree: the same prefixes and caches give the same homes, however
    each router came to know them."""
    ranks = ranks_for(list(sizes), len(caps))
    keys = list(sizes)
    rng.shuffle(keys)
    shuffled_ranks = {k: ranks[k] for k in keys}
    shuffled_sizes = {k: sizes[k] for k in reversed(keys)}
    assert place(ranks, sizes, caps) == place(shuffled_ranks, shuffled_sizes, caps)


@settings(max_examples=300, deadline=None)
@given(
    st.sets(st.integers(0, 10**6), min_size=1, max_size=40),
    st.integers(1, 60),
    st.lists(st.integers(1, 600), min_size=1, max_size=6),
)
def test_prefixes_that_fit_in_all_the_caches_fill_none_past_its_own(
    keys: set[int], size: int, caps: list[int]
) -> None:
    """Prefixes of one size (a fleet's tenants): where the caches together hold them all,
    every engine's homes fit in its cache, however unevenly hashing alone spreads them."""
    sizes = dict.fromkeys(keys, size)
    ranks = ranks_for(list(keys), len(caps))
    homes = place(ranks, sizes, caps)
    assert set(homes) == keys
    if len(keys) <= sum(cap // size for cap in caps):
        used = Counter(homes.values())
        assert all(used[at] * size <= cap for at, cap in enumerate(caps)), (used, caps)


@settings(max_examples=300, deadline=None)
@given(prefixes, st.integers(1, 6), st.booleans())
def test_where_everything_fits_the_home_is_the_first_rendezvous_choice(
    sizes: dict[int, int], n: int, unknown: bool
) -> None:
    caps = [0 if unknown else sum(sizes.values())] * n
    ranks = ranks_for(list(sizes), n)
    assert place(ranks, sizes, caps) == {k: r[0][0] for k, r in ranks.items()}


def test_four_routers_that_never_talk_agree_on_every_home_within_the_caches() -> None:
    """Tenants reach four routers in four different orders (as a load balancer in front of
    them spreads a fleet's requests); once each has seen every tenant, all four send each
    tenant to the same engine, three each (140 blocks less the eighth left for requests
    in flight holds three of 40), where hashing alone puts four or more on one. (Before the
    shared rule each router placed a prefix by its own sends: first come, first placed,
    and the four disagreed.)"""
    size, tenants = 40, 12
    cands = [[Cand(f"e{i}", cache_blocks=140) for i in range(4)] for _ in range(4)]
    plain = CacheAware[Cand]()
    spread = Counter(plain.ranking(cands[0], tenant(t, size))[0].id for t in range(tenants))
    assert max(spread.values()) > 3  # what hashing alone would do
    routers = [CacheAware[Cand](shared_homes=True) for _ in range(4)]
    orders = [random.Random(r).sample(range(tenants), tenants) for r in range(4)]
    for rounds in range(3):
        for r, balancer in enumerate(routers):
            for t in orders[r]:
                balancer.choose(cands[r], usable, None, tenant(t, size, tail=rounds + 1), at=0.0)
    homes: list[dict[int, str]] = []
    for r, balancer in enumerate(routers):
        picks = {}
        for t in range(tenants):
            pick = balancer.choose(cands[r], usable, None, tenant(t, size, tail=9), at=0.0)
            assert pick.endpoint is not None
            picks[t] = pick.endpoint.id
        homes.append(picks)
    assert homes[1:] == [homes[0]] * 3
    assert sorted(Counter(homes[0].values()).values()) == [3, 3, 3, 3]
