"""Issue 15.1 end to end: an engine's queue, read by its agent, reaches the routers.

Real control plane, agent (reading the simulated vLLM's /metrics into load reports) and
router. Requests past the engine's `--max-num-seqs` (sent through the router: the engine's
own port refuses a request without the secret its agent gave it) make its
`vllm:num_requests_waiting` rise; the router's endpoints view must show the engine's
figures (`engine`, read by the agent from the engine's /metrics, not the router's own
counts) and the waiting requests. The delay from the engine's own
metric to the router is printed, not asserted: speed is the benchmarks' business.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
from llmgw_testkit import wait_for
from llmgw_testkit.cluster import Cluster, metric_sum, vllm_profile


def router_endpoint(cluster: Cluster) -> dict[str, Any] | None:
    url = f"http://127.0.0.1:{cluster.router_admin_port}/v1/endpoints"
    endpoints = httpx.get(url, timeout=5).json()["endpoints"]
    return endpoints[0] if endpoints else None


def test_an_engine_queue_shows_at_the_router(cluster: Cluster) -> None:
    cluster.timings["load_interval"] = "250ms"
    profile = vllm_profile(args=["--max-num-seqs", "1"], env={"LLMGW_SIM_ITL": "0.05"})
    cluster.start_control([{"name": "chat", "profiles": {"default": profile}}])
    cluster.start_agent("gpu-a", gpus=1)
    cluster.start_router()
    (replica,) = cluster.wait_replicas("chat", 1, timeout=90)
    cluster.wait_router_models("chat")

    # Reports flow before any load: the router weighs the engine's figures.
    idle = wait_for(
        lambda: (ep := router_endpoint(cluster)) and ep["load_source"] == "engine" and ep,
        timeout=30,
        what="the router has the engine's figures",
    )
    assert idle["engine"]["waiting"] == 0
    engine_url = idle["url"]

    body = {"model": "chat", "prompt": "queue", "max_tokens": 60}
    threads = [
        threading.Thread(
            target=lambda: httpx.post(
                f"{cluster.router_url}/v1/completions", json=body, timeout=120
            )
        )
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    try:
        # One runs (max-num-seqs 1); the others wait in the engine's own queue.
        wait_for(
            lambda: metric_sum(httpx.get(f"{engine_url}/metrics", timeout=5).text,
                               "vllm:num_requests_waiting") >= 2,
            timeout=30,
            what="the engine reports waiting requests",
        )  # fmt: skip
        queued_at = time.monotonic()
        seen = wait_for(
            lambda: (
                (ep := router_endpoint(cluster))
                and ep["engine"] is not None
                and ep["engine"]["waiting"] >= 2
                and ep
            ),
            timeout=30,
            what="the router shows the engine's waiting requests",
        )
        print(f"engine queue at the router after {time.monotonic() - queued_at:.2f} s")
        assert seen["engine"]["running"] == 1
        assert seen["load_source"] == "engine"
        assert seen["load"] >= 3, "the balancer weighs running + waiting"
        assert seen["replica_id"] == replica["replica_id"]
    finally:
        for t in threads:
            t.join(timeout=120)
    # The queue drains, and so does the picture at the router.
    wait_for(
        lambda: (ep := router_endpoint(cluster)) and ep["engine"] and ep["engine"]["waiting"] == 0,
        timeout=60,
        what="the router sees the queue drained",
    )
