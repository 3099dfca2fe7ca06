"""Outlier ejection, retry budget, health thresholds and endpoint sets: pure logic."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st
from llmgw_router.budget import RetryBudget
from llmgw_router.config import HealthCheckConfig
from llmgw_router.endpoints import Endpoint, EndpointSet, EndpointSpec
from llmgw_router.health import apply_probe
from llmgw_router.outlier import (
    OutlierPolicy,
    OutlierState,
    ejection_time,
    record_failure,
    record_success,
)

policies = st.builds(
    OutlierPolicy,
    consecutive_failures=st.integers(1, 5),
    base_time=st.floats(0.1, 10),
    max_time=st.floats(10, 600),
)


@given(policies)
def test_consecutive_failures_eject_for_growing_times(policy: OutlierPolicy) -> None:
    state = OutlierState()
    now = 100.0
    durations = []
    for _ in range(6):
        for _ in range(policy.consecutive_failures):
            assert state.ejected_until <= now, "ejected before the threshold"
            state = record_failure(state, now, policy)
        assert state.ejected_until > now
        durations.append(state.ejected_until - now)
        now = state.ejected_until + 0.001
    assert all(later >= earlier - 1e-6 for earlier, later in itertools.pairwise(durations))
    assert max(durations) <= policy.max_time + 1e-9


@given(policies, st.lists(st.booleans(), max_size=30))
def test_a_success_resets_the_failure_streak(policy: OutlierPolicy, outcomes: list[bool]) -> None:
    state = OutlierState()
    now = 0.0
    streak = 0
    for ok in outcomes:
        now += 0.01
        if state.ejected_until > now:
            continue
        if ok:
            state = record_success(state, now, policy)
            streak = 0
        else:
            state = record_failure(state, now, policy)
            streak = 0 if state.ejected_until > now else streak + 1
        assert state.consecutive_failures == streak


def test_failures_while_ejected_do_not_extend_it() -> None:
    policy = OutlierPolicy(consecutive_failures=1, base_time=5, max_time=60)
    state = record_failure(OutlierState(), 0.0, policy)
    assert state.ejected_until == 5.0
    assert record_failure(state, 1.0, policy) == state
    assert ejection_time(policy, 100) == 60


@given(st.floats(0, 1), st.floats(0, 20), st.integers(0, 500))
def test_retry_budget_bounds_retries(ratio: float, floor: float, requests: int) -> None:
    budget = RetryBudget(ratio, floor, now=0.0)
    start = budget.tokens
    spent = 0
    for _ in range(requests):
        budget.on_request(0.0)
        if budget.try_spend(0.0):
            spent += 1
    # At one instant only the initial bucket plus what requests earned can be spent.
    assert spent <= start + ratio * requests + 1e-9


def test_retry_budget_refills_over_time() -> None:
    budget = RetryBudget(0.0, 2.0, now=0.0)
    while budget.try_spend(0.0):
        pass
    assert not budget.try_spend(0.1)
    assert budget.try_spend(1.0)


def test_health_thresholds() -> None:
    cfg = HealthCheckConfig(unhealthy_threshold=2, healthy_threshold=2)
    ep = Endpoint(spec=EndpointSpec(id="a", url="http://x", models=("m",)))
    assert apply_probe(ep, False, cfg) is None
    assert apply_probe(ep, False, cfg) is False
    assert not ep.usable(0.0)
    assert apply_probe(ep, True, cfg) is None
    assert apply_probe(ep, True, cfg) is True
    assert ep.usable(0.0)


def test_successor_keeps_live_state_of_unchanged_endpoints() -> None:
    a = EndpointSpec(id="a", url="http://a", models=("m",))
    b = EndpointSpec(id="b", url="http://b", models=("m",))
    first = EndpointSet([Endpoint(spec=a), Endpoint(spec=b)], version=1)
    ea, eb = first.endpoints
    ea.outstanding = 3
    a2 = EndpointSpec(id="a", url="http://a", models=("m", "m2"), weight=5)
    c = EndpointSpec(id="c", url="http://c", models=("m",))
    second = first.successor([a2, c], version=2, source="control")
    assert second.for_model("m2") == (ea,)
    assert ea.outstanding == 3
    assert ea.weight == 5
    assert eb.removed
    assert not ea.removed
    assert {ep.id for ep in second.for_model("m") or ()} == {"a", "c"}
    assert first.for_model("m") == (ea, eb), "the old set is not changed"


@given(st.integers(0, 20), st.integers(1, 20), st.floats(0, 100))
def test_ejection_cap(ejected: int, total: int, percent: float) -> None:
    from llmgw_router.outlier import may_eject

    policy = OutlierPolicy(max_ejection_percent=percent)
    ejected = min(ejected, total)
    allowed = may_eject(ejected, total, policy)
    if ejected == 0:
        assert allowed  # one may always go out
    elif allowed:
        assert (ejected + 1) * 100 <= percent * total


@given(st.integers(0, 20), st.integers(0, 20), st.floats(0, 100))
def test_panic_threshold(usable: int, total: int, threshold: float) -> None:
    from llmgw_router.outlier import in_panic

    usable = min(usable, total)
    panic = in_panic(usable, total, OutlierPolicy(panic_threshold=threshold))
    assert panic == (total > 0 and usable * 100 < threshold * total)
    if usable == total:
        assert not panic


def test_a_capped_failure_counts_but_does_not_eject() -> None:
    policy = OutlierPolicy(consecutive_failures=2)
    state = OutlierState()
    for _ in range(5):
        state = record_failure(state, 1.0, policy, allowed=False)
        assert state.ejected_until <= 1.0
    # Room again: the very next failure ejects.
    state = record_failure(state, 2.0, policy, allowed=True)
    assert state.ejected_until > 2.0


def test_every_endpoint_failing_at_once_leaves_the_model_served() -> None:
    """The state's guards together: ejection stops at the cap; panic sees them all."""
    from llmgw_proto.config import Duration
    from llmgw_router.config import EjectionConfig, RouterConfig
    from llmgw_router.metrics import Metrics
    from llmgw_router.state import RouterState

    eps = [
        Endpoint(spec=EndpointSpec(id=f"e{i}", url=f"http://e{i}", models=("m",))) for i in range(4)
    ]
    cfg = RouterConfig(ejection=EjectionConfig(consecutive_failures=1, base_time=Duration(60.0)))
    state = RouterState(cfg, EndpointSet(eps), Metrics())
    for _ in range(3):
        for ep in eps:
            state.record_failure(ep, "timeout_first_byte")
    import time

    now = time.monotonic()
    assert sum(1 for ep in eps if ep.outlier.ejected_until > now) == 2  # 50 % cap
    usable = state.usable_among(eps, now)
    assert sum(1 for ep in eps if usable(ep)) == 2
    # Health checks failing too: panic does not bring back unhealthy ones...
    eps[0].healthy = eps[1].healthy = eps[2].healthy = False
    usable = state.usable_among(eps, now)
    served = [ep for ep in eps if usable(ep)]
    # ...but with 1 of 4 usable (< 50 %), ejected-yet-healthy endpoints serve again.
    assert served
    assert all(ep.healthy for ep in served)
