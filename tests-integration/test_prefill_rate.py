"""Issue 26.1 end to end: the prefill rate cache_aware predicts times to first token with
is the engine's own. A simulated vLLM prefilling at 2 ms a prompt token (at most 500
tokens a second); its agent learns the rate from the engine's metrics
(`vllm:request_prompt_tokens_sum`, `vllm:request_prefill_time_seconds_sum`), the control
plane relays it, and the router's seconds per prefix block come from it."""

from __future__ import annotations

from typing import Any

import httpx
from llmgw_testkit import wait_for
from llmgw_testkit.cluster import Cluster, vllm_profile


def _endpoint(cluster: Cluster) -> dict[str, Any] | None:
    url = f"http://127.0.0.1:{cluster.router_admin_port}/v1/endpoints"
    eps = httpx.get(url, timeout=5).json()["endpoints"]
    return eps[0] if eps else None


def test_the_router_predicts_with_the_rate_the_engine_shows(cluster: Cluster) -> None:
    cluster.timings["load_interval"] = "250ms"
    profile = vllm_profile(env={"LLMGW_SIM_PREFILL_PER_TOKEN": "0.002", "LLMGW_SIM_TTFT": "0"})
    cluster.start_control([{"name": "chat", "profiles": {"default": profile}}])
    cluster.start_agent("gpu-a", gpus=1)
    cluster.start_router()
    cluster.wait_replicas("chat", 1, timeout=90)
    cluster.wait_router_models("chat")
    ep = _endpoint(cluster)
    assert ep is not None
    assert ep["block_time_from"] == "router"  # nothing learned yet
    for i in range(4):
        words = " ".join(f"w{i}x{j}" for j in range(100))
        body = {"model": "chat", "prompt": words, "max_tokens": 1}
        reply = httpx.post(f"{cluster.router_url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text

    def learned() -> dict[str, Any] | None:
        ep = _endpoint(cluster)
        if ep is None or ep["block_time_from"] != "engine" or ep["engine"] is None:
            return None
        return ep

    ep = wait_for(learned, timeout=60, what="the engine's prefill rate at the router")
    rate = ep["engine"]["prefill_tokens_per_second"]
    # It sleeps 2 ms a token and a little more: never faster than 500 tokens a second.
    assert 50 < rate <= 505
    # A prefix block is 64 tokens: at least 128 ms at this engine's rate.
    assert ep["block_time"] >= 0.127
