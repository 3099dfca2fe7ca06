"""The gate's pure parts (tenants/parts.py), by their public names: a request counted
through a model's gate and out again, a key's equal share of the room, and the name of
a budget period."""

from __future__ import annotations

import calendar
import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_router.tenants.fair import FairQueue
from llmgw_router.tenants.parts import Gate, enter, leave, period_of, under_share

BANDS = 3


def gate() -> Gate:
    return Gate(FairQueue(BANDS), by_band=[0] * BANDS)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, BANDS - 1)), max_size=30),
    st.randoms(use_true_random=False),
)
def test_what_enters_and_leaves_is_counted_by_key_and_band(
    requests: list[tuple[str, int]], rng: random.Random
) -> None:
    g = gate()
    inside: Counter[tuple[str, int]] = Counter()

    def check() -> None:
        assert g.in_flight == inside.total()
        assert g.by_band == [sum(n for (_, b), n in inside.items() if b == i) for i in range(BANDS)]
        by_key: Counter[str] = Counter()
        for (k, _), n in inside.items():
            by_key[k] += n
        # A key with nothing in flight is gone, not kept at 0.
        assert g.by_key == {k: n for k, n in by_key.items() if n}

    for key, band in requests:
        enter(g, key, band)
        inside[(key, band)] += 1
        check()
    out = list(requests)
    rng.shuffle(out)
    for key, band in out:
        leave(g, key, band)
        inside[(key, band)] -= 1
        check()
    assert (g.in_flight, g.by_key) == (0, {})


def test_a_key_is_under_its_share_below_an_equal_part_of_the_room() -> None:
    g = gate()
    for key, n in (("a", 3), ("b", 5)):
        for _ in range(n):
            enter(g, key, 0)
    # Room 8 between two keys: 4 each.
    assert under_share(g, "a", 8)
    assert not under_share(g, "b", 8)
    # A key with none in flight counts itself: 8 / 3 each.
    assert under_share(g, "c", 8)
    assert not under_share(g, "c", 0)
    assert not under_share(g, "a", 6)  # 3 of 6 between two: not below


def test_a_budget_period_is_named_by_its_utc_month_or_day() -> None:
    assert (period_of("month", 0.0), period_of("day", 0.0)) == ("1970-01", "1970-1")
    noon = calendar.timegm((2026, 12, 2, 12, 0, 0))
    assert period_of("month", noon) == "2026-12"
    assert period_of("day", noon) == "2026-336"
    # The day changes at midnight UTC, the month on its first day.
    midnight = calendar.timegm((2026, 12, 3, 0, 0, 0))
    assert period_of("day", midnight - 1) == "2026-336"
    assert period_of("day", midnight) == "2026-337"
    assert period_of("month", calendar.timegm((2027, 1, 1, 0, 0, 0)) - 1) == "2026-12"
    assert period_of("month", calendar.timegm((2027, 1, 1, 0, 0, 0))) == "2027-01"
