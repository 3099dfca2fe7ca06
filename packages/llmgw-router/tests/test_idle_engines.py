"""cache_aware with skewed demand (issue 26: no engine idle while another queues): a prefix
that carries more than half an endpoint's fair share of the picks spreads over its first
rendezvous choices, the one with the fewest requests awaiting a first token first; one
below that stays with its holder. Hypothesis properties and examples."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_router.balancing import CacheAware
from llmgw_testkit.candidates import Cand, usable


def tenant(t: int, blocks: int, tail: int) -> tuple[int, ...]:
    """A tenant's prompt as prefix blocks: its own chained hashes, then a unique tail."""
    head = tuple((t + 1) * 1_000_003 + i for i in range(blocks))
    return (*head, -(t + 1) * 1_000_003 - 7 * tail)


def history(balancer: CacheAware[Cand], cands: list[Cand], picks: list[int]) -> None:
    """Those tenants' requests, in that order, on an idle fleet."""
    for k, t in enumerate(picks):
        assert balancer.choose(cands, usable, None, tenant(t, 20, k), at=0.0).endpoint


def test_a_quarter_of_the_picks_over_four_spreads_over_two_and_an_eighth_stays() -> None:
    """Zipf-skewed tenants over 4 endpoints: the top one (a quarter of the picks) is more
    than half a fair share, (1 + 0.25) / 8: it takes its second rendezvous choice when
    that one is idle and the first has a request awaiting its first token. One with an
    eighth of the picks is below: it stays with its holder however busy (within the
    bound), where its prefix is cached."""
    cands = [Cand(f"e{i}") for i in range(4)]
    balancer = CacheAware[Cand](window=64)
    # 16 of 64 for tenant 0, 8 for tenant 1, the rest spread over 10 others.
    picks = [0 if k % 4 == 0 else 1 if k % 8 == 1 else 2 + k % 10 for k in range(64)]
    history(balancer, cands, picks)
    top, top_second, *_ = balancer.ranking(cands, tenant(0, 20, 0))
    top.load, top.awaiting_first = 2.0, 1
    pick = balancer.choose(cands, usable, None, tenant(0, 20, 100), at=0.0)
    assert (pick.endpoint, pick.reason) == (top_second, "hot_spread")
    for c in cands:
        c.load, c.awaiting_first = 0.0, 0
    held = [c for c in cands if balancer.matched(c, tenant(1, 20, 0)) == 20]
    assert len(held) == 1
    held[0].load, held[0].awaiting_first = 2.0, 1
    pick = balancer.choose(cands, usable, None, tenant(1, 20, 101), at=0.0)
    assert (pick.endpoint, pick.reason) == (held[0], "holder")


def test_with_the_same_demand_both_replicas_serve_in_turn() -> None:
    """Its two rendezvous choices idle alike: the hot prefix alternates between them, so
    both keep it cached (neither ages it out while the other takes every request)."""
    cands = [Cand(f"e{i}") for i in range(4)]
    balancer = CacheAware[Cand](window=64)
    history(balancer, cands, [0 if k % 4 == 0 else 2 + k % 10 for k in range(64)])
    first, second, *_ = balancer.ranking(cands, tenant(0, 20, 0))
    chosen = set()
    for k in range(4):
        endpoint = balancer.choose(cands, usable, None, tenant(0, 20, 200 + k), at=0.0).endpoint
        assert endpoint is not None
        chosen.add(endpoint.id)
    assert chosen == {first.id, second.id}


@settings(max_examples=200, deadline=None)
@given(
    st.integers(2, 6),
    st.sampled_from([0.0, 0.25, 1.0]),
    st.integers(0, 32),
    st.data(),
)
def test_a_prefix_over_half_a_fair_share_never_waits_where_a_first_choice_has_no_queue(
    n: int, epsilon: float, hot: int, data: st.DataObject
) -> None:
    """Whatever the queues: a prefix whose share of the recent picks (this one included)
    is over ``(1 + epsilon) / (2 n)`` goes where no more requests await a first token (and
    no more load, at equal waits) than at either of its first two rendezvous choices.
    Below that share, it goes to its holder (the bound being out of the way)."""
    window = 32
    cands = [Cand(f"e{i}") for i in range(n)]
    # A large slack: the bound never decides here (its own tests cover it).
    balancer = CacheAware[Cand](epsilon=epsilon, slack=1000.0, window=window)
    picks = [0 if k < hot else 1 + k % 6 for k in range(window - 1)]
    data.draw(st.randoms(use_true_random=False)).shuffle(picks)
    history(balancer, cands, picks)
    for c in cands:
        c.awaiting_first = data.draw(st.integers(0, 3))
        c.load = float(c.awaiting_first + data.draw(st.integers(0, 3)))
    share = (hot + 1) / window
    need = min(n, math.ceil(2 * share * n / (1 + epsilon) - 1e-9))
    first_two = balancer.ranking(cands, tenant(0, 20, 0))[:2]
    holders = [c for c in cands if balancer.matched(c, tenant(0, 20, 0)) == 20]
    pick = balancer.choose(cands, usable, None, tenant(0, 20, 999), at=0.0)
    chosen = pick.endpoint
    assert chosen is not None
    if need > 1:
        assert pick.reason == "hot_spread"
        assert all(
            (chosen.awaiting_first, chosen.load) <= (c.awaiting_first, c.load) for c in first_two
        )
    elif holders:
        assert len(holders) == 1
        # Its holder, unless another's predicted time is lower by more than the move.
        assert pick.reason in ("holder", "predicted_ttft", "home_again")
        assert pick.reason != "holder" or chosen is holders[0]
