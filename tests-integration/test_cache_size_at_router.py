"""Issue 26.2 and 25.2 end to end: an engine's KV-cache size, read by its agent from the
engine's own /metrics (vLLM's cache_config_info), reaches the router through the control
plane, and every pick the router makes is counted with its reason.

Real control plane, agent (launching the simulated vLLM with a given cache) and router.
"""

from __future__ import annotations

from typing import Any

import httpx
from llmgw_testkit import wait_for
from llmgw_testkit.cluster import Cluster, metric_sum, vllm_profile

BLOCKS = 1088


def router_endpoint(cluster: Cluster) -> dict[str, Any] | None:
    url = f"http://127.0.0.1:{cluster.router_admin_port}/v1/endpoints"
    endpoints = httpx.get(url, timeout=5).json()["endpoints"]
    return endpoints[0] if endpoints else None


def test_the_engines_cache_size_reaches_the_router_and_picks_say_why(cluster: Cluster) -> None:
    cluster.timings["load_interval"] = "250ms"
    profile = vllm_profile(args=["--num-gpu-blocks-override", str(BLOCKS)])
    cluster.start_control([{"name": "chat", "profiles": {"default": profile}}])
    cluster.start_agent("gpu-a", gpus=1)
    cluster.start_router()
    cluster.wait_replicas("chat", 1, timeout=90)
    cluster.wait_router_models("chat")

    seen = wait_for(
        lambda: (ep := router_endpoint(cluster)) and ep.get("cache_tokens") and ep,
        timeout=60,
        what="the router has the engine's cache size",
    )
    assert seen["cache_tokens"] == BLOCKS * 16
    # Counted in prefix blocks: block_bytes (256) / bytes_per_token (4) tokens each.
    assert seen["cache_blocks"] == BLOCKS * 16 // 64

    url = f"http://127.0.0.1:{cluster.router_port}/v1/chat/completions"
    system = " ".join(f"w{i}" for i in range(600))
    for turn in range(3):
        body = {
            "model": "chat",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"question {turn}"},
            ],
            "max_tokens": 2,
        }
        assert httpx.post(url, json=body, timeout=60).status_code == 200
    metrics = cluster.router_metrics()
    # One endpoint: every pick is the only one, and says so.
    assert metric_sum(metrics, "llmgw_router_picks_total", model="chat", reason="only") == 3
    after = router_endpoint(cluster)
    assert after is not None
    assert after["live_prefix_blocks"] > 0
    assert after["pending_prefill_blocks"] == 0
