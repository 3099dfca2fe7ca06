"""The prefill rate cache_aware predicts the time to first token with (issue 26.1): the
engine's own, as its agent learned it from the engine's metrics and the control plane
relayed it (EndpointLoad.prefill_tokens_per_second), else the router's own estimate from
its times to first byte (static endpoints, or before the engine's first window)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from llmgw_proto import v1
from llmgw_router.balancing.model import ttft_costs
from llmgw_router.control.watch import load_from_wire
from llmgw_router.endpoints import Endpoint, EndpointSpec, EngineLoad
from llmgw_testkit import wait_for


def config(control: Any) -> dict[str, Any]:
    return {
        "control": {"address": control.address, "tls": {"insecure": True}},
        "health_checks": {"enabled": False},
    }


def endpoint(router: Any, ident: str) -> dict[str, Any]:
    return next(ep for ep in router.endpoints()["endpoints"] if ep["id"] == ident)


def make(ident: str = "e1") -> Endpoint:
    return Endpoint(spec=EndpointSpec(id=ident, url="http://127.0.0.1:1", models=("m",)))


def wire(rate: float) -> v1.EndpointLoad:
    return v1.EndpointLoad(
        endpoint_id="e1", known=True, age=dt.timedelta(0), prefill_tokens_per_second=rate
    )


@given(
    rate=st.floats(1.0, 1e7),
    block_tokens=st.floats(1.0, 4096.0),
    learned=st.floats(0.0, 10.0),
)
def test_a_reported_rate_sets_the_seconds_per_block_and_wins_over_the_learned_one(
    rate: float, block_tokens: float, learned: float
) -> None:
    ep = make()
    ep.block_tokens = block_tokens
    ep.learned_block_time = learned
    assert ep.block_time == learned  # nothing reported: the router's own
    load = load_from_wire(wire(rate), 100.0)
    assert load is not None
    ep.report(load)
    assert ep.block_time == block_tokens / rate


@given(rate=st.sampled_from([float("nan"), float("inf"), -5.0, 0.0]))
def test_a_rate_that_is_no_rate_is_not_taken(rate: float) -> None:
    load = load_from_wire(wire(rate), 100.0)
    assert load is not None
    assert load.prefill_tokens_per_second == 0.0
    ep = make()
    ep.learned_block_time = 0.01
    ep.report(load)
    assert ep.block_time == 0.01


@given(slow=st.floats(10.0, 1e5), factor=st.floats(1.01, 100.0), miss=st.integers(1, 500))
def test_the_engine_that_prefills_faster_is_predicted_sooner(
    slow: float, factor: float, miss: int
) -> None:
    a, b = make("a"), make("b")
    a.report(EngineLoad(prefill_tokens_per_second=slow, measured_at=0.0))
    b.report(EngineLoad(prefill_tokens_per_second=slow * factor, measured_at=0.0))
    cost_a, cost_b = ttft_costs([a, b], [miss, miss], [None, None], 0.0, prior=0.0064)
    assert cost_b < cost_a


def test_the_router_predicts_with_the_rate_the_control_plane_relays(
    spawn_router: Any, upstreams: list[Any], control: Any
) -> None:
    e1, e2 = upstreams
    control.publish(1, e1, e2)
    # e1's agent learned 2,000 prompt tokens a second; e2's has not said yet.
    control.set_loads(
        [
            {"endpoint_id": "e1-replica", "running": 0, "prefill_tokens_per_second": 2000.0},
            {"endpoint_id": "e2-replica", "running": 0},
        ]
    )
    router = spawn_router(config(control))
    wait_for(
        lambda: endpoint(router, "e1-replica")["block_time_from"] == "engine",
        what="e1's prefill rate at the router",
    )
    view = endpoint(router, "e1-replica")
    assert view["engine"]["prefill_tokens_per_second"] == 2000.0
    # A prefix block is block_bytes / 4 = 64 tokens by default: 32 ms at 2,000 tokens/s.
    assert view["block_time"] == 0.032
    assert endpoint(router, "e2-replica")["block_time_from"] == "router"
