"""A real llama-server's life as the control plane sees it: STARTING while its /health
answers 503 (model loading), READY once it answers 200, FAILED with its own output tail
when it is killed, then restarted."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

from llmgw_testkit import http_get, wait_for
from llmgw_testkit.cluster import Cluster

SERVED_NAME = "gemma3"


def _health(port: int) -> int:
    try:
        status, _ = http_get(f"http://127.0.0.1:{port}/health", timeout=2)
    except OSError:
        return 0  # not listening yet
    return status


def _shard(cluster: Cluster) -> dict[str, Any] | None:
    for replica in cluster.replicas(SERVED_NAME):
        for shard in replica["shards"]:
            if shard["pid"] > 0:
                result: dict[str, Any] = shard
                return result
    return None


def test_starting_while_loading_ready_after_failed_when_killed(
    cpu_cluster: Cluster, start_cpu_agent: Callable[[str], None]
) -> None:
    cluster = cpu_cluster
    start_cpu_agent("cpu-a")

    # Each sample reads the control plane's view first, then the engine's /health. /health
    # goes 503 -> 200 once and never back, so a reported state read before a 503 was
    # reported while the engine was still loading.
    samples: list[tuple[str, int]] = []

    def starting_seen_during_503_or_loaded() -> bool:
        shard = _shard(cluster)
        if shard is None:
            return False
        samples.append((shard["state"], _health(shard["port"])))
        return samples[-1] == ("starting", 503) or samples[-1][1] == 200

    wait_for(starting_seen_during_503_or_loaded, timeout=180, interval=0.01, what="loading")
    assert samples[-1] == ("starting", 503), f"no sample saw the model load: {samples}"
    assert not [s for s in samples if s[0] == "ready"], samples

    (replica,) = cluster.wait_replicas(SERVED_NAME, 1, timeout=180)
    (shard,) = replica["shards"]
    assert shard["state"] == "ready"
    assert _health(shard["port"]) == 200
    first_pid = shard["pid"]

    # SIGKILL: no chance to say goodbye; the agent reports what the engine last wrote.
    os.kill(first_pid, signal.SIGKILL)

    def reported_failed() -> dict[str, Any] | None:
        (replica,) = cluster.replicas(SERVED_NAME)
        return replica if replica["failures"] >= 1 else None

    failed = wait_for(reported_failed, timeout=60, what="the killed engine reported")
    tail = str(failed["output_tail"])
    # llama.cpp's own log lines: loading the model, then listening on the port it was given.
    assert "load_model: loading model" in tail, tail
    assert f"listening on http://127.0.0.1:{shard['port']}" in tail, tail
    assert "SIGKILL" in str(failed["last_error"]), failed
    agent = cluster.agents["cpu-a"]
    agent.wait_output('"state": "FAILED"', timeout=30)

    # Restarted after backoff: a new engine process, ready again.
    def restarted() -> dict[str, Any] | None:
        shard = _shard(cluster)
        ok = shard and shard["pid"] != first_pid and shard["state"] == "ready"
        return shard if ok else None

    again = wait_for(restarted, timeout=180, what="a new engine ready after the kill")
    assert _health(again["port"]) == 200
