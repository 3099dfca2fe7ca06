"""The status page's history (issue 29 point 4): per-model figures from what the
control plane holds, and an hour of them in a ring buffer."""

from __future__ import annotations

import asyncio
import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from llmgw_control.history import (
    History,
    ModelFigures,
    RequestIntake,
    model_rows,
    quantile,
    run_sampler,
)
from llmgw_proto import v1


def test_model_rows_count_ready_replicas_and_their_load() -> None:
    rows = model_rows(
        {"chat": 2, "idle": 0},
        [
            ("chat", "ready", {"running": 3, "waiting": 1, "kv_cache_usage": 0.5, "known": True}),
            ("chat", "ready", {"running": 1, "waiting": 0, "kv_cache_usage": 0.25}),
            ("chat", "starting", {"running": 9, "waiting": 9, "kv_cache_usage": 1.0}),
            ("chat", "ready", {"running": 7, "known": False}),
            ("extra", "ready", None),
        ],
    )
    none = {"requests_per_s": None, "error_rate": None, "ttft_p50": None, "ttft_p90": None}
    assert [{**r.as_json(), **none} for r in rows] == [
        {**x, **none}
        for x in [
            {
                "model": "chat",
                "wanted": 2,
                "ready": 3,
                "running": 4,
                "waiting": 1,
                "kv_cache": 0.375,
            },
            {
                "model": "extra",
                "wanted": 0,
                "ready": 1,
                "running": 0,
                "waiting": 0,
                "kv_cache": None,
            },
            {
                "model": "idle",
                "wanted": 0,
                "ready": 0,
                "running": 0,
                "waiting": 0,
                "kv_cache": None,
            },
        ]
    ]


states = st.sampled_from(["ready", "starting", "failed", "unreachable"])
loads = st.none() | st.fixed_dictionaries(
    {
        "running": st.integers(0, 50),
        "waiting": st.integers(0, 50),
        "kv_cache_usage": st.floats(0, 1),
        "known": st.booleans(),
    }
)
names = st.sampled_from(["a", "b", "c"])


@given(
    st.dictionaries(names, st.integers(0, 5)),
    st.lists(st.tuples(names, states, loads), max_size=12),
)
def test_model_rows_properties(
    wanted: dict[str, int], replicas: list[tuple[str, str, dict[str, Any] | None]]
) -> None:
    rows = {r.model: r for r in model_rows(wanted, replicas)}
    assert set(rows) == set(wanted) | {m for m, _, _ in replicas}
    for name, row in rows.items():
        mine = [(s, load) for m, s, load in replicas if m == name]
        assert row.ready == sum(1 for s, _ in mine if s == "ready")
        assert row.wanted == wanted.get(name, 0)
        kvs = [x["kv_cache_usage"] for s, x in mine if s == "ready" and x and x["known"]]
        if kvs:
            assert row.kv_cache is not None
            assert min(kvs) - 1e-9 <= row.kv_cache <= max(kvs) + 1e-9
        else:
            assert row.kv_cache is None


def test_history_keeps_the_last_points_and_fills_gaps_with_null() -> None:
    history = History(step=10, points=3)
    for t in range(5):
        rows = [ModelFigures("a", 1, 1, t, 0, 0.1)]
        if t >= 3:
            rows.append(ModelFigures("b", 1, 0, 0, 0, None))
        history.add(float(t), rows)
    out = history.as_json()
    assert out["times"] == [2.0, 3.0, 4.0]
    assert out["models"]["a"]["running"] == [2, 3, 4]
    assert out["models"]["b"]["ready"] == [None, 0, 0]
    assert out["models"]["b"]["kv_cache"] == [None, None, None]


async def test_the_sampler_samples_until_cancelled_and_survives_a_failure() -> None:
    history = History(step=0.01, points=100)
    calls = 0

    def take() -> list[ModelFigures]:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("one bad sample")
        return [ModelFigures("a", 1, 1, 0, 0, None)]

    task = asyncio.create_task(run_sampler(history, take))
    deadline = asyncio.get_running_loop().time() + 30
    while len(history.as_json()["times"]) < 3:
        assert asyncio.get_running_loop().time() < deadline, "the sampler stopped"
        await asyncio.sleep(0.01)
    task.cancel()
    assert calls >= 4


def test_quantile_interpolates_inside_the_bucket() -> None:
    buckets = {0.1: 0, 0.25: 10, 0.5: 10, math.inf: 0}
    assert quantile(0.5, buckets) == 0.25
    assert quantile(0.25, buckets) == 0.1 + (0.25 - 0.1) * 0.5
    assert quantile(0.9, {1.0: 0, math.inf: 4}) == 1.0  # in +Inf: the highest bound
    assert quantile(0.5, {}) is None


@given(
    st.dictionaries(
        st.sampled_from([0.01, 0.05, 0.1, 0.5, 1.0, 5.0, math.inf]), st.integers(0, 50)
    ),
    st.floats(0.01, 0.99),
    st.floats(0.01, 0.99),
)
def test_quantile_is_monotone_and_within_the_bounds(
    buckets: dict[float, int], q1: float, q2: float
) -> None:
    a, b = quantile(min(q1, q2), buckets), quantile(max(q1, q2), buckets)
    if sum(buckets.values()) == 0:
        assert a is None
        assert b is None
        return
    assert a is not None
    assert b is not None
    assert 0 <= a <= b <= 5.0


def test_the_intake_sums_routers_and_refuses_bad_reports() -> None:
    clock = [100.0]
    intake = RequestIntake(clock=lambda: clock[0])

    def report(router: str, requests: int, errors: int) -> v1.RequestReport:
        return v1.RequestReport(
            router_id=router,
            models=[
                v1.ModelRequests(
                    model="chat",
                    requests=requests,
                    errors=errors,
                    ttft_bounds=[0.1, 1.0, math.inf],
                    ttft_counts=[requests, 0, 0],
                )
            ],
        )

    assert intake.add(report("r1", 30, 3)) is None
    assert intake.add(report("r2", 70, 2)) is None
    assert intake.add(v1.RequestReport(router_id="")) == "router_id: 1 to 253 characters"
    bad = v1.RequestReport(
        router_id="r", models=[v1.ModelRequests(model="m", ttft_bounds=[1.0], ttft_counts=[])]
    )
    assert "must pair up" in (intake.add(bad) or "")
    clock[0] += 10
    (chat,) = intake.take().values()
    assert chat.requests_per_s == 10.0
    assert chat.error_rate == 0.05
    assert chat.ttft_p50 == 0.05
    clock[0] += 10
    assert intake.take() == {}
    rows = model_rows({"chat": 1}, [], {"chat": chat})
    assert rows[0].as_json()["requests_per_s"] == 10.0
