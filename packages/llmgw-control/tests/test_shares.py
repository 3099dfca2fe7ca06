"""Shares of a key's limits among routers (pure): properties and examples."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st
from llmgw_control import shares

routers = st.lists(st.text("abcdefgh", min_size=1, max_size=3), min_size=1, max_size=8, unique=True)
demand = st.one_of(
    st.floats(0, 1e7, allow_nan=False), st.just(0.0), st.sampled_from([math.nan, -1.0, math.inf])
)


@st.composite
def demands(draw: st.DrawFn) -> dict[str, float]:
    return {r: draw(demand) for r in draw(routers)}


@given(st.integers(0, 2**53).map(float), demands())
def test_rate_shares_never_sum_above_the_limit_and_each_router_gets_some(
    limit: float, wants: dict[str, float]
) -> None:
    got = shares.split(limit, wants)
    assert set(got) == set(wants)
    assert math.fsum(got.values()) <= limit
    if limit > 0:
        assert all(s > 0 for s in got.values())


@given(st.integers(1, 2**53).map(float), demands(), st.data())
def test_more_demand_never_less_share(
    limit: float, wants: dict[str, float], data: st.DataObject
) -> None:
    """A router's share grows (or stays) as its demand grows, the others' alike."""
    r = data.draw(st.sampled_from(sorted(wants)))
    before = shares.split(limit, wants)[r]
    more = {**wants, r: (wants[r] if wants[r] > 0 and math.isfinite(wants[r]) else 0.0) + 10.0}
    assert shares.split(limit, more)[r] >= before * (1 - 1e-9)


def test_demands_that_fit_get_what_they_want_and_the_rest_is_split() -> None:
    got = shares.split(100.0, {"a": 50.0, "b": 10.0})
    assert _near(got, a=70.0, b=30.0)


def test_uneven_demand_over_the_limit_moves_the_shares() -> None:
    got = shares.split(100.0, {"a": 900.0, "b": 100.0})
    # 10 % evenly (5 each), 90 % by demand (81 and 9).
    assert _near(got, a=86.0, b=14.0)
    moved = shares.split(100.0, {"a": 100.0, "b": 900.0})
    assert _near(moved, a=14.0, b=86.0)
    # A router that just came, with no demand yet, still gets its floor.
    assert shares.split(100.0, {"a": 900.0, "new": 0.0})["new"] > 0


@given(st.integers(0, 10_000), demands())
def test_whole_shares(limit: int, wants: dict[str, float]) -> None:
    got = shares.split_whole(limit, wants)
    assert set(got) == set(wants)
    if limit == 0:
        assert all(v == 0 for v in got.values())
    elif limit >= len(wants):
        assert sum(got.values()) == limit
        assert all(v >= 1 for v in got.values())
    else:
        assert all(v == 1 for v in got.values())


@given(st.integers(-100, 10**12), demands(), st.data())
def test_budget_grants_never_exceed_what_is_left(
    remaining: int, wants: dict[str, float], data: st.DataObject
) -> None:
    router = data.draw(st.sampled_from(sorted(wants)))
    others = {r: data.draw(st.integers(0, max(remaining, 0))) for r in wants if r != router}
    got = shares.grant(remaining, router, wants, others)
    assert got >= 0
    assert got + sum(others.values()) <= max(remaining, 0) or got == 0
    assert got <= max(remaining, 0)


@given(st.integers(1, 10**9), routers, st.lists(st.integers(0, 10**6), max_size=200), st.data())
def test_grants_outstanding_never_sum_above_what_is_left(
    budget: int, names: list[str], spend: list[int], data: st.DataObject
) -> None:
    """Routers report in any order and use any part of their grants: what the fleet
    used plus what is granted and unused never exceeds the budget."""
    used = 0
    held: dict[str, int] = {}
    for amount in spend:
        r = data.draw(st.sampled_from(names))
        # The router used part of what it held and reports it; its grant is replaced.
        spent = min(amount, held.get(r, 0))
        used += spent
        wants = {n: data.draw(st.floats(0, 1e6)) for n in names}
        held[r] = shares.grant(budget - used, r, wants, held)
        assert used + sum(held.values()) <= budget


def test_a_lone_router_is_granted_what_is_left() -> None:
    assert shares.grant(1000, "a", {"a": 5.0}, {}) == 999  # rounding kept safe
    assert shares.grant(1000, "a", {"a": 5.0}, {"b": 600}) <= 400
    assert shares.grant(0, "a", {"a": 5.0}, {}) == 0


def _near(got: dict[str, float], **want: float) -> bool:
    return all(math.isclose(got[r], v, rel_tol=1e-6) for r, v in want.items())


@given(
    st.integers(1, 10**6),
    routers,
    st.lists(st.tuples(st.integers(0, 7), st.floats(0, 1e6)), max_size=100),
)
def test_rate_shares_held_never_sum_above_the_limit_while_demand_moves(
    limit: int, names: list[str], reports: list[tuple[int, float]]
) -> None:
    """Routers report in any order with any demand; each gets its target bounded by
    what the others hold: the shares held never sum above the limit."""
    demand = dict.fromkeys(names, 0.0)
    held: dict[str, float] = {}
    for which, want in reports:
        r = names[which % len(names)]
        demand[r] = shares.smooth(demand[r], want, 0.25)
        target = shares.split(float(limit), demand)[r]
        held[r] = shares.bounded(target, float(limit), {o: v for o, v in held.items() if o != r})
        assert math.fsum(held.values()) <= limit * (1 + 1e-9)
        assert held[r] >= 0


def test_held_shares_settle_on_the_targets() -> None:
    """Once every router has reported twice with steady demand, each holds its target."""
    demand = {"a": 900.0, "b": 100.0}
    held: dict[str, float] = {"a": 0.0, "b": 95.0}
    for _ in range(2):
        for r in ("a", "b"):
            target = shares.split(100.0, demand)[r]
            held[r] = shares.bounded(target, 100.0, {o: v for o, v in held.items() if o != r})
    assert _near(held, a=86.0, b=14.0)


@given(st.one_of(st.none(), st.floats(0, 1e6)), st.floats(0, 1e6), st.floats(0, 100))
def test_smoothed_demand_lies_between_the_old_and_the_new(
    previous: float | None, current: float, elapsed: float
) -> None:
    got = shares.smooth(previous, current, elapsed)
    low, high = sorted((current, current if previous is None else previous))
    assert low - 1e-6 <= got <= high + 1e-6
