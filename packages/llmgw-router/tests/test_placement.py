"""cache_aware's placement rules (balancing.placement): several routers that saw the same
prefixes give each the same home, within the engines' caches (place); one router alone
gives no endpoint more than its share of the prefixes (balanced_home). Hypothesis
properties and examples."""

from __future__ import annotations

import math
import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_router.balancing import CacheAware
from llmgw_router.balancing.placement import balanced_home, place
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


held_prefixes = st.dictionaries(
    st.integers(0, 10**6), st.tuples(st.integers(1, 60), st.integers(0, 5)), min_size=1,
    max_size=40,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(held_prefixes, capacities, st.randoms(use_true_random=False))
def test_with_holders_the_homes_do_not_depend_on_the_order_either(
    given_: dict[int, tuple[int, int]], caps: list[int], rng: random.Random
) -> None:
    sizes = {k: size for k, (size, _) in given_.items()}
    held = {k: at % len(caps) for k, (_, at) in given_.items() if at}
    ranks = ranks_for(list(sizes), len(caps))
    keys = list(sizes)
    rng.shuffle(keys)
    again = place({k: ranks[k] for k in keys}, {k: sizes[k] for k in reversed(keys)}, caps,
                  {k: held[k] for k in reversed(keys) if k in held})  # fmt: skip
    assert place(ranks, sizes, caps, held) == again


@settings(max_examples=300, deadline=None)
@given(held_prefixes, st.lists(st.integers(1, 600), min_size=1, max_size=6))
def test_a_holder_keeps_its_prefixes_while_they_fit(
    given_: dict[int, tuple[int, int]], caps: list[int]
) -> None:
    """Where what each engine holds fits its cache, every held prefix's home is its
    holder, wherever hashing would put it."""
    n = len(caps)
    sizes = {k: size for k, (size, _) in given_.items()}
    held = {k: at % n for k, (_, at) in given_.items() if at}
    load = Counter[int]()
    for k, at in held.items():
        load[at] += sizes[k]
    homes = place(ranks_for(list(sizes), n), sizes, caps, held)
    for k, at in held.items():
        if load[at] <= caps[at]:
            assert homes[k] == at


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.integers(0, 10**6), st.integers(0, 6), min_size=1, max_size=40),
    st.integers(1, 60),
    st.lists(st.integers(1, 600), min_size=1, max_size=6),
)
def test_an_over_full_holder_keeps_what_fits_and_none_overflows_where_all_fit(
    holders: dict[int, int], size: int, caps: list[int]
) -> None:
    """Prefixes of one size (a fleet's tenants), some held (an engine may hold more than
    its cache: the rule before left them all there): each holder keeps as many of its
    own as fit, and where the caches together hold them all, none is filled past its
    own."""
    n = len(caps)
    sizes = dict.fromkeys(holders, size)
    held = {k: at % n for k, at in holders.items() if at}
    homes = place(ranks_for(list(holders), n), sizes, caps, held)
    assert set(homes) == set(holders)
    fits = [cap // size for cap in caps]
    for at in range(n):
        mine = [k for k, h in held.items() if h == at]
        kept = sum(1 for k in mine if homes[k] == at)
        assert kept >= min(len(mine), fits[at])
    if len(holders) <= sum(fits):
        used = Counter(homes.values())
        assert all(used[at] <= fits[at] for at in range(n)), (used, caps)


@settings(max_examples=300, deadline=None)
@given(held_prefixes, st.lists(st.tuples(st.integers(1, 600), st.integers(0, 8)), min_size=1,
                               max_size=6))  # fmt: skip
def test_a_holder_keeps_what_fits_its_whole_cache_beyond_the_reserve(
    given_: dict[int, tuple[int, int]], caches: list[tuple[int, int]]
) -> None:
    """``whole``: the caches without the reserve the rule keeps for requests in flight.
    What a holder holds stays while it fits the whole cache (a move for the reserve's
    sake is a miss, and the prefixes moved in its place did not fit either: with a
    reserve alone, four routers' homes went round in a cycle of three moves)."""
    n = len(caches)
    whole = [cap for cap, _ in caches]
    caps = [cap - cap * eighths // 8 for cap, eighths in caches]
    sizes = {k: size for k, (size, _) in given_.items()}
    held = {k: at % n for k, (_, at) in given_.items() if at}
    load = Counter[int]()
    for k, at in held.items():
        load[at] += sizes[k]
    homes = place(ranks_for(list(sizes), n), sizes, caps, held, whole=whole)
    for k, at in held.items():
        if load[at] <= whole[at]:
            assert homes[k] == at


def test_eight_held_prefixes_each_stay_where_the_reserve_leaves_room_for_seven() -> None:
    """32 tenants of 60 or 68 blocks, 8 held on each of 4 engines whose caches hold 578
    blocks, 506 less the reserve: with ``whole`` each stays; without, two swap engines
    (each move a miss, and the next computation may swap others)."""
    rng = random.Random(0)
    ranks = ranks_for(list(range(32)), 4)
    sizes = {k: rng.choice([60, 68]) for k in range(32)}
    keys = list(range(32))
    rng.shuffle(keys)
    held = {k: i % 4 for i, k in enumerate(keys)}
    caps, whole = [506] * 4, [578] * 4
    assert place(ranks, sizes, caps, held, whole=whole) == held
    moved = place(ranks, sizes, caps, held)
    assert {k for k in held if moved[k] != held[k]} == {7, 22}


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(1, 4), min_size=1, max_size=6),
    st.integers(1, 80),
    st.randoms(use_true_random=False),
)
def test_no_endpoint_is_home_to_more_than_its_share_of_the_prefixes(
    weights: list[int], k: int, rng: random.Random
) -> None:
    """Placed one after another, each in its own rendezvous order, ``k`` prefixes leave
    every endpoint at most ``ceil(k * weight / total_weight)`` (less by the rounding
    only), and each went to the first of its order that was under its share then."""
    n, total = len(weights), sum(weights)
    homed = [0] * n
    for placed in range(1, k + 1):
        order = list(range(n))
        rng.shuffle(order)
        home, under = balanced_home(order, homed, weights, None)
        assert under[home]
        assert not any(under[i] for i in order[: order.index(home)])
        assert under == [
            h < math.ceil(placed * w / total) for h, w in zip(homed, weights, strict=True)
        ]
        homed[home] += 1
    assert sum(homed) == k
    assert all(h <= math.ceil(k * w / total) for h, w in zip(homed, weights, strict=True))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 12), min_size=2, max_size=6),
    st.randoms(use_true_random=False),
)
def test_a_prefix_moves_only_to_an_endpoint_it_ranks_higher_and_moves_end(
    homed: list[int], rng: random.Random
) -> None:
    """A prefix with a home moves only to an endpoint it ranks higher, under its share,
    that then has fewer than its home had; applied to every prefix again and again, the
    moves stop (each evens the counts) and leave no prefix that could still move."""
    n = len(homed)
    weights = [1] * n
    prefixes: list[tuple[list[int], int]] = []
    for at, count in enumerate(homed):
        for _ in range(count):
            order = list(range(n))
            rng.shuffle(order)
            prefixes.append((order, at))
    if not prefixes:
        return
    counts = list(homed)
    for _ in range(len(prefixes) * n + 1):
        moved = False
        for j, (order, at) in enumerate(prefixes):
            without = list(counts)
            without[at] -= 1
            home, under = balanced_home(order, without, weights, at)
            assert order.index(home) <= order.index(at)
            if home != at:
                assert under[home]
                assert counts[home] + 1 < counts[at]
                counts[at] -= 1
                counts[home] += 1
                prefixes[j] = (order, home)
                moved = True
        if not moved:
            break
    else:
        raise AssertionError("the moves did not end")


def test_thirty_two_prefixes_over_four_endpoints_are_eight_each() -> None:
    """Rendezvous alone gives 32 prefixes over 4 endpoints as 11/9/6/6 as often as 8 each;
    an endpoint's weight doubles its share."""
    homed = [0] * 4
    for key in range(32):
        order = [i for i, _ in ranks_for([key], 4)[key]]
        homed[balanced_home(order, homed, [1] * 4, None)[0]] += 1
    assert homed == [8, 8, 8, 8]
    homed = [0] * 3
    for key in range(32):
        order = [i for i, _ in ranks_for([key], 3)[key]]
        homed[balanced_home(order, homed, [2, 1, 1], None)[0]] += 1
    assert homed == [16, 8, 8]
