"""The load estimate the cache-aware balancer weighs: an engine's figures at the time they
were read, corrected by what this router did since (pure, no I/O)."""

from __future__ import annotations

import time

from hypothesis import given
from hypothesis import strategies as st
from llmgw_router.endpoints import Endpoint, EndpointSpec, EngineLoad


def make() -> Endpoint:
    return Endpoint(spec=EndpointSpec(id="e1", url="http://127.0.0.1:1", models=("m",)))


def test_sends_and_finishes_after_the_reading_correct_it() -> None:
    ep = make()
    t0 = time.monotonic()
    ep.report(EngineLoad(measured_at=t0 - 0.5))
    # Two requests in flight when the engine's figures are read at t0 ...
    ep.sent(t0 - 0.2)
    ep.sent(t0 - 0.1)
    ep.outstanding = 2
    # ... a third sent and one finished after the reading, before the report arrives.
    ep.sent(t0 + 0.01)
    ep.outstanding += 1
    ep.finished(t0 + 0.02)
    ep.outstanding -= 1
    ep.report(EngineLoad(running=2, waiting=3, kv_cache_usage=0.5, measured_at=t0))
    # 2 running + 3 waiting (two of them from other routers) + 1 sent - 1 finished.
    assert ep.sent_since_report == 1
    assert ep.finished_since_report == 1
    assert ep.load_at(time.monotonic()) == 5.5
    # Each completion seen by this router takes one off until the next reading.
    ep.finished(t0 + 0.03)
    ep.outstanding -= 1
    assert ep.load_at(time.monotonic()) == 4.5


def test_nothing_is_counted_apart_without_engine_figures() -> None:
    ep = make()
    ep.sent(time.monotonic())
    ep.finished(time.monotonic())
    assert ep.sent_since_report == 0
    assert ep.finished_since_report == 0


def test_never_below_this_routers_own_in_flight_count() -> None:
    ep = make()
    t0 = time.monotonic()
    ep.report(EngineLoad(running=0, waiting=0, measured_at=t0))
    ep.outstanding = 4  # four sent before the engine saw them, charged in an old report
    assert ep.load_at(time.monotonic()) == 4.0


def test_unknown_or_stale_figures_fall_back_to_own_counts() -> None:
    ep = make()
    ep.outstanding = 3
    ep.report(EngineLoad(measured_at=time.monotonic()))
    ep.sent(time.monotonic())
    assert ep.sent_since_report == 1
    ep.report(None)
    assert ep.load_at(time.monotonic()) == 3.0
    assert ep.sent_since_report == 0
    ep.report(EngineLoad(running=9, measured_at=time.monotonic() - 10 * Endpoint.load_max_age))
    assert ep.load_at(time.monotonic()) == 3.0


@given(
    st.lists(st.tuples(st.floats(0, 1, allow_nan=False), st.booleans()), min_size=0, max_size=60),
    st.floats(0, 1, allow_nan=False),
    st.integers(0, 20),
)
def test_only_what_happened_after_the_reading_is_counted(
    events: list[tuple[float, bool]], reading: float, reported: int
) -> None:
    ep = make()
    base = time.monotonic() - 1.0  # the reading within load_max_age of now
    ep.report(EngineLoad(measured_at=base - 1.0))  # an earlier one, to correct
    for at, is_send in sorted(events):
        (ep.sent if is_send else ep.finished)(base + at)
    ep.report(EngineLoad(running=reported, measured_at=base + reading))
    sends = sum(1 for at, s in events if s and base + at > base + reading)
    finishes = sum(1 for at, s in events if not s and base + at > base + reading)
    assert ep.sent_since_report == sends
    assert ep.finished_since_report == finishes
    assert ep.load_at(time.monotonic()) == max(reported + sends - finishes, ep.outstanding)
