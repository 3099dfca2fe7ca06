"""The engine's prefill rate, learned from its own metrics (llmgw_agent.prefill)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from llmgw_agent.adapters import LLAMACPP, SGLANG, VLLM
from llmgw_agent.load import (
    LoadReporter,
    LoadSource,
    engine_load,
    metric_values,
    prefill_counters,
)
from llmgw_agent.prefill import PrefillCounters, PrefillRate
from llmgw_testkit import free_port, http_get, running, wait_for

SIM = Path(sys.executable).parent / "llmgw-sim"

# (prompt tokens, cached tokens, prefill seconds) added between two readings.
steps = st.lists(
    st.tuples(st.integers(0, 5000), st.integers(0, 5000), st.floats(0.0, 3.0, allow_nan=False)),
    max_size=30,
)


def readings(rate: float, steps: list[tuple[int, int, float]]) -> list[PrefillCounters]:
    """Cumulative counters of an engine that computes ``rate`` tokens per second of
    prefill: each step's computed tokens are its seconds times the rate."""
    out = []
    prompt = cached = seconds = 0.0
    for _, hits, secs in steps:
        seconds += secs
        cached += hits
        prompt += hits + rate * secs
        out.append(PrefillCounters(prompt, cached, seconds))
    return out


@given(rate=st.floats(10.0, 1e6), steps=steps)
def test_an_engine_of_one_rate_is_learned_at_that_rate(
    rate: float, steps: list[tuple[int, int, float]]
) -> None:
    est = PrefillRate()
    for reading in readings(rate, steps):
        learned = est.update(reading)
        assert learned == 0.0 or abs(learned - rate) <= 1e-6 * rate


@given(
    values=st.lists(
        st.one_of(
            st.none(),
            st.builds(
                PrefillCounters,
                st.floats(allow_nan=True, allow_infinity=True),
                st.floats(allow_nan=True, allow_infinity=True),
                st.floats(allow_nan=True, allow_infinity=True),
            ),
        ),
        max_size=30,
    )
)
def test_any_readings_give_a_finite_rate_never_below_zero(
    values: list[PrefillCounters | None],
) -> None:
    est = PrefillRate()
    for value in values:
        rate = est.update(value)
        assert rate >= 0.0
        assert rate < float("inf")


def test_a_window_gathers_enough_prefill_and_a_restart_keeps_the_rate() -> None:
    est = PrefillRate(min_seconds=0.05, min_tokens=64)
    assert est.update(PrefillCounters(0, 0, 0)) == 0.0
    # 10 tokens in 10 ms: too little to tell; the window goes on.
    assert est.update(PrefillCounters(10, 0, 0.01)) == 0.0
    # 1,010 tokens of which 10 cached, in 1.01 s since the window began.
    assert est.update(PrefillCounters(1010, 10, 1.01)) == pytest.approx(1000 / 1.01)
    before = est.rate
    # The engine restarted: its counters start again; the rate stays.
    assert est.update(PrefillCounters(5, 0, 0.001)) == before
    assert est.update(PrefillCounters(2005, 0, 1.001)) == pytest.approx(
        before + 0.2 * (2000 - before)
    )
    assert est.update(None) == est.rate


VLLM_TEXT = """\
vllm:num_requests_running{engine="0",model_name="m"} 0.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 100.0
vllm:request_prompt_tokens_sum{engine="0",model_name="m"} 600.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 0.5
"""
SGLANG_TEXT = """\
sglang:num_running_reqs{model_name="m"} 0.0
sglang:prompt_tokens_total{model_name="m"} 600.0
sglang:cached_tokens_total{model_name="m"} 100.0
sglang:time_to_first_token_seconds_sum{model_name="m"} 0.5
"""
LLAMACPP_TEXT = """\
llamacpp:requests_processing 0
llamacpp:prompt_tokens_total 500
llamacpp:prompt_seconds_total 0.5
"""


@pytest.mark.parametrize(
    ("adapter", "text"), [(VLLM, VLLM_TEXT), (SGLANG, SGLANG_TEXT), (LLAMACPP, LLAMACPP_TEXT)]
)
def test_each_engines_names_give_its_rate(adapter: object, text: str) -> None:
    metrics = adapter.load  # type: ignore[attr-defined]
    est = PrefillRate()
    zero = text.replace("600.0", "0").replace("500", "0").replace("0.5", "0")
    zero = zero.replace("100.0", "0")
    assert engine_load(zero, metrics, shard_id="s", generation=1, prefill=est).known
    load = engine_load(text, metrics, shard_id="s", generation=1, prefill=est)
    # 500 tokens computed in 0.5 s of prefill.
    assert load.prefill_tokens_per_second == pytest.approx(1000.0)


@pytest.mark.skipif(not SIM.exists(), reason="llmgw-sim is not installed")
def test_the_agent_learns_a_simulated_engines_prefill_rate(tmp_path: Path) -> None:
    # A simulated vLLM that takes 2 ms per prompt token not cached: at most 500 tokens/s.
    port = free_port()
    argv = [
        str(SIM), "vllm", "serve", "m", "--host", "127.0.0.1", "--port", str(port),
        "--sim-load-time", "0", "--sim-ttft", "0", "--sim-itl", "0",
        "--sim-prefill-per-token", "0.002",
    ]  # fmt: skip
    with running(argv, log_dir=tmp_path, name="sim") as proc:
        url = f"http://127.0.0.1:{port}"
        wait_for(
            lambda: http_get(f"{url}/health")[0] == 200, timeout=60, what=f"sim: {proc.tail()}"
        )
        source = LoadSource("s", f"{url}/metrics", VLLM.load, generation=1)
        reporter = LoadReporter(
            lambda: [source], lambda report: None, interval=lambda: 0.25, session=lambda: 1
        )
        assert asyncio.run(reporter.read(source)).prefill_tokens_per_second == 0.0
        for i in range(3):
            prompt = " ".join(f"w{i}x{j}" for j in range(100))
            reply = httpx.post(
                f"{url}/v1/completions",
                json={"model": "m", "prompt": prompt, "max_tokens": 1},
                timeout=60,
            )
            assert reply.status_code == 200, reply.text
        load = asyncio.run(reporter.read(source))
        # Its prefills slept 2 ms a token and a little more: about 500 tokens/s, never more.
        assert 100 < load.prefill_tokens_per_second <= 500 * 1.01


def test_a_real_vllm_scrape_has_the_figures() -> None:
    # vLLM 0.32.0 on the CPU, after a request (tests-real-vllm/data).
    data = Path(__file__).parents[3] / "tests-real-vllm" / "data" / "vllm-0.32.0-metrics.txt"
    text = data.read_text()
    names = (VLLM.load.prompt_tokens, VLLM.load.prefill_seconds, VLLM.load.prefix_hits)
    counters = prefill_counters(metric_values(text, names), VLLM.load)
    assert counters is not None
    assert counters.prompt_tokens == 22.0
    assert counters.seconds == pytest.approx(0.6968, abs=1e-3)
