"""The step scheduler in a real simulator process: queueing, budget, cache, metrics."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
from llmgw_sim.metrics import parse_prometheus
from llmgw_sim.testing import Sim, engine_argv, run_to_exit, start
from llmgw_testkit import free_port, wait_for
from llmgw_testkit.checks import stream_chat_with_usage

STEP = ["--sim-scheduler", "step"]
SYSTEM = " ".join(f"rule{i}" for i in range(400))  # a 400-token shared system prompt


def _chat(sim: Sim, user: str, *, max_tokens: int = 4, model: str = "org/model") -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
    }
    r = httpx.post(sim.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _samples(sim: Sim) -> dict[str, float]:
    return parse_prometheus(httpx.get(sim.url + "/metrics", timeout=10).text)


def _value(samples: dict[str, float], name: str) -> float:
    hits = [v for k, v in samples.items() if k == name or k.startswith(name + "{")]
    assert hits, f"{name} missing"
    return hits[0]


def test_shared_prefix_hits_the_block_cache(tmp_path: Path) -> None:
    with start(tmp_path, "vllm", STEP) as sim:
        first = _chat(sim, "first question")
        before = _samples(sim)
        second = _chat(sim, "another question")
        after = _samples(sim)
        prompt = second["usage"]["prompt_tokens"]
        assert first["usage"]["completion_tokens"] == second["usage"]["completion_tokens"] == 4
        queried = _value(after, "vllm:prefix_cache_queries_total") - _value(
            before, "vllm:prefix_cache_queries_total"
        )
        hit = _value(after, "vllm:prefix_cache_hits_total") - _value(
            before, "vllm:prefix_cache_hits_total"
        )
        assert queried == prompt
        # The system prompt's full 16-token blocks (at least 400 tokens) came from the cache,
        # the differing user turn did not.
        assert 400 <= hit < prompt
        assert hit % 16 == 0
        # Nothing runs: no block is referenced, the cached ones count as free.
        assert _value(after, "vllm:kv_cache_usage_perc") == 0.0
        assert _value(after, "vllm:prompt_tokens_cached_total") >= hit


def test_queue_beyond_max_num_seqs_and_kv_usage_while_running(tmp_path: Path) -> None:
    # Slow steps so requests stay in flight while the metrics are read.
    args = [*STEP, "--max-num-seqs", "2", "--sim-step-time", "0.05", "--sim-decode-seq-time", "0"]
    with start(tmp_path, "vllm", args) as sim:
        threads = [
            threading.Thread(target=_chat, args=(sim, f"q{i}"), kwargs={"max_tokens": 40})
            for i in range(5)
        ]
        for t in threads:
            t.start()
        try:
            sim.wait_metric("vllm:num_requests_running", 2)
            sim.wait_metric("vllm:num_requests_waiting", 3)
            assert sim.metric("vllm:kv_cache_usage_perc") > 0
        finally:
            for t in threads:
                t.join(timeout=60)
        sim.wait_metric("vllm:num_requests_running", 0)
        sim.wait_metric("vllm:num_requests_waiting", 0)
        assert sim.metric("vllm:kv_cache_usage_perc") == 0


def test_token_budget_bounds_every_step(tmp_path: Path) -> None:
    with start(tmp_path, "vllm", [*STEP, "--max-num-batched-tokens", "64"]) as sim:
        _chat(sim, "a long prompt goes through in chunks")
        samples = _samples(sim)
        total = _value(samples, "vllm:iteration_tokens_total_count")
        within = next(
            v
            for k, v in samples.items()
            if k.startswith("vllm:iteration_tokens_total_bucket") and 'le="64"' in k
        )
        # 400+ prompt tokens at most 64 a step: several prefill steps, none above the budget.
        assert total >= 7
        assert within == total


def test_streams_one_chunk_per_token_through_the_openai_client(tmp_path: Path) -> None:
    with start(tmp_path, "vllm", [*STEP, "--sim-step-time", "0.005"]) as sim:
        got = stream_chat_with_usage(sim.url, "org/model", max_tokens=12, content="count")
        contents = got.deltas
        assert contents[0] == ""  # the role chunk
        assert len([c for c in contents[1:] if c]) == 12
        assert got.chunks[-1].usage is not None
        assert got.chunks[-1].usage.completion_tokens == 12


def test_client_leaving_frees_its_slot_and_blocks(tmp_path: Path) -> None:
    args = [*STEP, "--sim-step-time", "0.05"]
    with start(tmp_path, "vllm", args) as sim:
        body = {
            "model": "org/model",
            "messages": [{"role": "user", "content": "long answer"}],
            "max_tokens": 500,
            "stream": True,
        }
        with httpx.stream("POST", sim.url + "/v1/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept: a dropped iterator closes the response
            assert next(lines).startswith("data: ")
            assert sim.metric("vllm:num_requests_running") == 1
        sim.wait_metric("vllm:num_requests_running", 0)
        wait_for(
            lambda: sim.metric("vllm:kv_cache_usage_perc") == 0,
            timeout=15,
            what="the aborted request's blocks are released",
        )


def test_sglang_and_llama_report_their_own_names(tmp_path: Path) -> None:
    args = [*STEP, "--sim-step-time", "0.05"]
    with start(
        tmp_path / "sg", "sglang", [*args, "--enable-metrics", "--max-running-requests", "1"]
    ) as sg:
        threads = [
            threading.Thread(target=_chat, args=(sg, f"q{i}"), kwargs={"max_tokens": 60})
            for i in range(3)
        ]
        for t in threads:
            t.start()
        try:
            sg.wait_metric("sglang:num_running_reqs", 1)
            sg.wait_metric("sglang:num_queue_reqs", 2)
            assert sg.metric("sglang:token_usage") > 0
        finally:
            for t in threads:
                t.join(timeout=60)
        _chat(sg, "q0")  # the same prompt again: a cache hit
        assert sg.metric("sglang:cache_hit_rate") > 0
    with start(tmp_path / "ll", "llama-server", [*args, "--metrics", "-np", "1"]) as ll:
        threads = [
            threading.Thread(
                target=_chat, args=(ll, f"q{i}"), kwargs={"model": "m", "max_tokens": 60}
            )
            for i in range(3)
        ]
        for t in threads:
            t.start()
        try:
            ll.wait_metric("llamacpp:requests_processing", 1)
            ll.wait_metric("llamacpp:requests_deferred", 2)
            assert ll.metric("llamacpp:kv_cache_usage_ratio") > 0
        finally:
            for t in threads:
                t.join(timeout=60)


def test_vllm_refuses_a_max_model_len_its_kv_cache_cannot_hold(tmp_path: Path) -> None:
    args = [*STEP, "--num-gpu-blocks-override", "64", "--max-model-len", "4096"]
    proc = run_to_exit(
        tmp_path, engine_argv("vllm", free_port(), args), env={"CUDA_VISIBLE_DEVICES": "0"}
    )
    assert proc.returncode == 1
    assert "To serve at least one request with the model's max seq len (4096)" in proc.output
    assert "the estimated maximum model length is 1024" in proc.output
