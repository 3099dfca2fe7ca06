from __future__ import annotations

import random
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st
from llmgw_proto.backoff import Backoff, exponential, full_jitter

bases = st.floats(0.01, 10.0)


@given(attempt=st.integers(0, 10_000), base=bases, factor=st.floats(1.0, 1000.0))
def test_exponential_grows_to_the_cap_and_stays(attempt: int, base: float, factor: float) -> None:
    cap = base * factor
    delay = exponential(attempt, base, cap)
    assert base <= delay <= cap
    assert exponential(attempt + 1, base, cap) >= delay


@given(
    attempt=st.integers(0, 200),
    base=bases,
    factor=st.floats(1.0, 100.0),
    u=st.floats(0.0, 0.999999),
)
def test_full_jitter_stays_within_zero_and_the_ceiling(
    attempt: int, base: float, factor: float, u: float
) -> None:
    cap = base * factor
    delay = full_jitter(attempt, base, cap, lambda: u)
    assert 0.0 <= delay <= exponential(attempt, base, cap)


@given(seed=st.integers(0, 2**32))
def test_a_fleet_does_not_reconnect_in_lockstep(seed: int) -> None:
    # 200 agents that lost the control plane together, each on its own random stream.
    master = random.Random(seed)
    delays = [Backoff(1.0, 30.0, rng=random.Random(master.random())).next() for _ in range(200)]
    assert all(0.0 <= d <= 1.0 for d in delays)
    # Spread over the whole window, not bunched: a uniform draw has stdev ~0.29.
    assert statistics.pstdev(delays) > 0.2
    assert len({round(d, 6) for d in delays}) > 190


def test_backoff_resets_after_success() -> None:
    backoff = Backoff(0.5, 8.0, rng=random.Random(1))
    for _ in range(10):
        backoff.next()
    assert backoff.attempt == 10
    backoff.reset()
    assert backoff.next() <= 0.5


@pytest.mark.parametrize(("base", "cap"), [(0.0, 1.0), (2.0, 1.0), (-1.0, 5.0)])
def test_bad_bounds_are_refused(base: float, cap: float) -> None:
    with pytest.raises(ValueError, match="base"):
        Backoff(base, cap)
