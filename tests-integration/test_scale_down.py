"""Scenario 5: scaling a model down drains the removed replica: its in-flight streams finish."""

from __future__ import annotations

import json
import signal
import threading
import urllib.request

from llmgw_testkit import wait_for
from llmgw_testkit.checks import stream_chat_with_usage
from llmgw_testkit.cluster import Cluster, metric_sum, vllm_profile


def running_requests(endpoint: str) -> float:
    with urllib.request.urlopen(f"{endpoint}/metrics", timeout=5) as resp:
        return metric_sum(resp.read().decode(), "vllm:num_requests_running")


def test_scale_down_drains_and_in_flight_streams_complete(cluster: Cluster) -> None:
    slow = vllm_profile(gpus=1, replicas=2, env={"LLMGW_SIM_ITL": "0.05"})
    models = [{"name": "chat", "profiles": {"default": slow}}]
    cluster.start_control(models)
    cluster.start_agent("gpu-a", gpus=2)
    cluster.start_router(balancer="round_robin")
    replicas = cluster.wait_replicas("chat", 2)
    endpoints = {r["replica_id"]: r["endpoint"] for r in replicas}
    cluster.wait_router_models("chat")

    outcomes: list[tuple[str, int]] = []

    def stream() -> None:
        try:
            # expect_tokens=0: the count is checked below, with every stream's outcome.
            got = stream_chat_with_usage(
                cluster.router_url,
                "chat",
                max_tokens=120,
                content="a long story",
                timeout=60,
                expect_tokens=0,
            )
            finish = got.finishes
            outcomes.append((finish[-1] if finish else "none", got.usage.completion_tokens))
        except Exception as err:
            outcomes.append((f"error: {err!r}", 0))

    threads = [threading.Thread(target=stream) for _ in range(4)]
    for t in threads:
        t.start()
    # Both engines are busy with streams before the scale-down.
    wait_for(
        lambda: all(running_requests(url) >= 1 for url in endpoints.values()),
        timeout=30,
        what="streams running on both replicas",
    )

    config_path = cluster.workdir / "control.yaml"
    config = json.loads(config_path.read_text())
    config["models"][0]["profiles"]["default"]["replicas"] = 1
    config_path.write_text(json.dumps(config, indent=2))
    assert cluster.control is not None
    cluster.control.signal(signal.SIGHUP)

    draining = wait_for(
        lambda: [r for r in cluster.replicas("chat") if r["state"] == "draining"],
        timeout=30,
        what="one replica draining",
    )
    removed = draining[0]
    for t in threads:
        t.join(timeout=60)
    assert outcomes == [("length", 120)] * 4

    wait_for(lambda: len(cluster.replicas("chat")) == 1, timeout=60, what="one replica left")
    (kept,) = cluster.replicas("chat")
    assert kept["replica_id"] != removed["replica_id"]
    pid = removed["shards"][0]["pid"]
    wait_for(lambda: not _alive(pid), timeout=30, what="drained engine stopped")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False
