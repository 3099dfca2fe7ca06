"""Load reports: the engines' own metrics, parsed and sent up on change."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from llmgw_agent.adapters import LLAMACPP, SGLANG, VLLM
from llmgw_agent.agent import Agent
from llmgw_agent.config import AgentConfig
from llmgw_agent.load import LoadReporter, LoadSource, engine_load, metric_values
from llmgw_proto import v1
from llmgw_testkit import free_port, wait_for_async

S = v1.ShardState


async def until(condition: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    async def check() -> Any:
        return condition()

    return await wait_for_async(check, timeout=timeout, what=what)


# Lines of a real vLLM 0.32.0 /metrics scrape on the CPU with one request running
# (tests-real-vllm/data/vllm-0.32.0-metrics-busy.txt).
VLLM_BUSY = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="gemma"} 1.0
vllm:num_requests_waiting{engine="0",model_name="gemma"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="gemma",reason="capacity"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="gemma",reason="deferred"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="gemma"} 0.035502958579881616
vllm:prefix_cache_queries_total{engine="0",model_name="gemma"} 32.0
vllm:prefix_cache_queries_created{engine="0",model_name="gemma"} 1.7961156636794796e+09
vllm:prefix_cache_hits_total{engine="0",model_name="gemma"} 0.0
vllm:prefix_cache_hits_created{engine="0",model_name="gemma"} 1.7961156636795044e+09
"""

SGLANG_TEXT = """\
sglang:num_running_reqs{model_name="m"} 3.0
sglang:num_queue_reqs{model_name="m"} 7.0
sglang:token_usage{model_name="m"} 0.28
sglang:cache_hit_rate{model_name="m"} 0.5
sglang:prompt_tokens_total{model_name="m"} 1000.0
sglang:cached_tokens_total{model_name="m",cache_source="device"} 300.0
sglang:cached_tokens_total{model_name="m",cache_source="host"} 100.0
"""

LLAMACPP_TEXT = """\
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
llamacpp:requests_deferred 1
llamacpp:kv_cache_usage_ratio 0.63
"""


def test_vllm_real_names() -> None:
    load = engine_load(VLLM_BUSY, VLLM.load, shard_id="s", generation=7)
    assert load.known
    assert (load.running, load.waiting) == (1, 0)
    assert abs(load.kv_cache_usage - 0.0355) < 1e-3
    # The counters are exposed with _total; the _created samples are not counted.
    assert (load.prefix_cache_queries, load.prefix_cache_hits) == (32, 0)
    assert load.generation == 7


def test_sglang_and_llamacpp_names() -> None:
    sg = engine_load(SGLANG_TEXT, SGLANG.load, shard_id="s", generation=1)
    assert (sg.running, sg.waiting, sg.prefix_cache_queries, sg.prefix_cache_hits) == (
        3,
        7,
        1000,
        400,
    )
    assert abs(sg.kv_cache_usage - 0.28) < 1e-6
    ll = engine_load(LLAMACPP_TEXT, LLAMACPP.load, shard_id="s", generation=1)
    assert (ll.known, ll.running, ll.waiting) == (True, 2, 1)
    assert abs(ll.kv_cache_usage - 0.63) < 1e-6


def test_no_running_metric_means_unknown() -> None:
    assert not engine_load("other_metric 1\n", VLLM.load, shard_id="s", generation=1).known


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["vllm:num_requests_running", "vllm:num_requests_running_by_x", "x"]),
            st.integers(0, 1000),
        ),
        max_size=10,
    )
)
def test_metric_values_sums_exactly_the_named_metric(samples: list[tuple[str, int]]) -> None:
    text = "".join(f'{name}{{engine="{i}"}} {value}\n' for i, (name, value) in enumerate(samples))
    expected = sum(v for n, v in samples if n == "vllm:num_requests_running")
    found = metric_values(text, ["vllm:num_requests_running"])
    assert found.get("vllm:num_requests_running", 0.0) == expected
    assert ("vllm:num_requests_running" in found) == any(
        n == "vllm:num_requests_running" for n, _ in samples
    )


@contextlib.asynccontextmanager
async def metrics_server(body: list[str]) -> AsyncIterator[int]:
    """A tiny HTTP server answering /metrics with ``body[0]``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        data = body[0].encode()
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


async def test_reporter_sends_only_changes_and_everything_on_a_new_stream() -> None:
    body = [LLAMACPP_TEXT]
    sent: list[v1.LoadReport] = []
    session = [1]
    async with metrics_server(body) as port:
        dead = free_port()  # nothing listens here: that engine is unknown
        sources = [
            LoadSource("a", f"http://127.0.0.1:{port}/metrics", LLAMACPP.load, 11),
            LoadSource("b", f"http://127.0.0.1:{dead}/metrics", LLAMACPP.load, 22),
        ]
        reporter = LoadReporter(
            lambda: sources, sent.append, interval=lambda: 0.05, session=lambda: session[0]
        )
        first = await reporter.round()
        assert first is not None
        by_shard = {e.shard_id: e for e in first.engines}
        assert by_shard["a"].known
        assert by_shard["a"].running == 2
        assert not by_shard["b"].known
        assert by_shard["b"].generation == 22
        # Nothing changed: nothing sent.
        assert await reporter.round() is None
        body[0] = LLAMACPP_TEXT.replace("requests_processing 2", "requests_processing 5")
        second = await reporter.round()
        assert second is not None
        assert [(e.shard_id, e.running) for e in second.engines] == [("a", 5)]
        # A new stream: the control plane gets every engine again.
        session[0] = 2
        third = await reporter.round()
        assert third is not None
        assert {e.shard_id for e in third.engines} == {"a", "b"}
        # No stream: nothing is read or queued.
        session[0] = 0
        assert await reporter.round() is None
    assert len(sent) == 3


async def test_agent_reports_an_engines_load_changes_on_its_stream(
    kit: Any, control: Any, make_config: Callable[..., AgentConfig], reap: list[int], tmp_path: Path
) -> None:
    control.load_interval = 0.05  # RegisterAck.load_interval overrides agent.yaml's
    config = make_config(
        control={"address": f"127.0.0.1:{control.port}", "tls": {"insecure": True}},
        stop_engines_on_exit=True,
    )
    running_file = tmp_path / "running"
    running_file.write_text("0")
    agent = Agent(config)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        await until(control.registers, "Register")
        start = kit.make_start(port=free_port(), env={"SIM_RUNNING_FILE": str(running_file)})
        control.send(v1.ControlMessage(start_shard=start))
        ready = await until(lambda: [s for s in control.statuses() if s.state == S.READY], "READY")
        reap.append(ready[0].pid)

        def loads() -> list[v1.EngineLoad]:
            return [e for r in control.load_reports() for e in r.engines]

        first = await until(lambda: [e for e in loads() if e.known], "a known load")
        assert first[0].shard_id == start.shard_id
        assert first[0].running == 0
        generation = first[0].generation
        assert generation > 0
        running_file.write_text("3")
        await until(lambda: [e for e in loads() if e.running == 3], "running 3 reported")
        assert agent.link.load_interval == 0.05
        # Only changes: no two reports in a row carry the same figures for the engine.
        figures = [(e.known, e.running, e.waiting) for e in loads()]
        assert all(a != b for a, b in itertools.pairwise(figures))
        assert {e.generation for e in loads()} == {generation}
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)


def test_the_cache_size_in_tokens_each_engine_reports() -> None:
    """vLLM: cache_config_info's num_gpu_blocks x block_size (an info metric's labels);
    SGLang: max_total_num_tokens; llama.cpp says nothing (0)."""
    info = (
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",'
        'num_gpu_blocks="1088",prefix_caching_hash_algo="sha256"} 1.0\n'
    )
    vllm = engine_load(VLLM_BUSY + info, VLLM.load, shard_id="s", generation=1)
    assert vllm.cache_tokens == 1088 * 16
    assert engine_load(VLLM_BUSY, VLLM.load, shard_id="s", generation=1).cache_tokens == 0
    broken = info.replace('"1088"', '"None"')
    assert engine_load(VLLM_BUSY + broken, VLLM.load, shard_id="s", generation=1).cache_tokens == 0
    # vLLM 0.32 on gemma-3 270M (sliding-window layers: 6 KV groups share the blocks): its
    # own kv_cache_size_tokens, not blocks x block size (15,008).
    hybrid = (
        'vllm:cache_config_info{block_size="32",engine="0",kv_cache_size_tokens="2377",'
        'num_gpu_blocks="469"} 1.0\n'
    )
    assert engine_load(VLLM_BUSY + hybrid, VLLM.load, shard_id="s", generation=1).cache_tokens == (
        2377
    )
    unknown = hybrid.replace('"2377"', '"None"')
    assert engine_load(VLLM_BUSY + unknown, VLLM.load, shard_id="s", generation=1).cache_tokens == (
        469 * 32
    )
    sglang = SGLANG_TEXT + 'sglang:max_total_num_tokens{model_name="m"} 471258.0\n'
    assert engine_load(sglang, SGLANG.load, shard_id="s", generation=1).cache_tokens == 471258
    ll = engine_load(LLAMACPP_TEXT, LLAMACPP.load, shard_id="s", generation=1)
    assert ll.cache_tokens == 0
