"""Scenario 4: an engine that crashes is reported FAILED with its output, restarted with
backoff, and the router fails traffic over to the healthy replica meanwhile."""

from __future__ import annotations

import threading
from typing import Any

import openai
from llmgw_testkit import wait_for
from llmgw_testkit.cluster import Cluster, vllm_profile


def test_crashing_engine_is_reported_restarted_and_traffic_fails_over(cluster: Cluster) -> None:
    # Two profiles serve one model; the flaky one's engine dies after a few requests
    # with a CUDA error, as real engines do.
    flaky_env = {"LLMGW_SIM_CRASH_AFTER_REQUESTS": "3"}
    models = [
        {
            "name": "chat",
            "profiles": {
                "stable": vllm_profile(gpus=1),
                "flaky": vllm_profile(gpus=1, env=flaky_env),
            },
        }
    ]
    cluster.start_control(models)
    cluster.start_agent("gpu-a", gpus=4)
    cluster.start_router()
    wait_for(
        lambda: len([r for r in cluster.replicas("chat") if r["state"] == "ready"]) == 2,
        timeout=60,
        what="both profiles ready",
    )
    cluster.wait_router_models("chat")

    client = openai.OpenAI(
        base_url=f"{cluster.router_url}/v1", api_key="x", max_retries=0, timeout=30
    )
    results: list[str] = []
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            try:
                reply = client.chat.completions.create(
                    model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=3
                )
                results.append("ok" if reply.choices[0].message.content else "empty")
            except Exception as err:
                results.append(f"error: {err!r}")

    worker = threading.Thread(target=traffic)
    worker.start()
    try:

        def flaky() -> dict[str, Any]:
            return next(r for r in cluster.replicas("chat") if r["profile"] == "flaky")

        failed = wait_for(
            lambda: (r := flaky())["failures"] >= 1 and r,
            timeout=60,
            what="the flaky engine's crash reported",
        )
        assert "CUDA error" in str(failed["output_tail"]), failed["output_tail"]
        assert "exit" in str(failed["last_error"]) or "code" in str(failed["last_error"])
        # Restarted, not at once: backoff first, then ready again with a new engine.
        wait_for(lambda: flaky()["state"] == "ready", timeout=60, what="flaky restarted")
        wait_for(lambda: len(results) >= 40, timeout=60, what="traffic across the crash")
    finally:
        stop.set()
        worker.join(timeout=60)
    failures = [r for r in results if r != "ok"]
    assert failures == [], failures[:5]
