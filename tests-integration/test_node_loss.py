"""Scenario 2: a killed agent's node goes UNREACHABLE, then LOST; its replica moves."""

from __future__ import annotations

import signal
import subprocess
from typing import Any

from llmgw_testkit.cluster import Cluster, bin_path, vllm_profile


def explain(cluster: Cluster, model: str) -> str:
    return subprocess.run(
        [
            bin_path("llmgw-control"),
            "explain",
            model,
            "--admin",
            f"http://127.0.0.1:{cluster.admin_port}",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout


def test_killed_agent_goes_unreachable_then_lost_and_its_replica_moves(cluster: Cluster) -> None:
    cluster.start_control([{"name": "chat", "profiles": {"default": vllm_profile(gpus=4)}}])
    cluster.start_agent("gpu-a", gpus=4)
    cluster.start_agent("gpu-b", gpus=4)
    cluster.start_router()
    (first,) = cluster.wait_replicas("chat", 1)
    (old_node,) = first["nodes"]
    other = "gpu-b" if old_node == "gpu-a" else "gpu-a"
    cluster.wait_router_models("chat")

    cluster.agents[old_node].stop(signal.SIGKILL)
    cluster.wait_node_state(old_node, "UNREACHABLE", timeout=30)
    # Merely unreachable: the engine may still serve, so its endpoint stays published.
    assert cluster.router_models() == {"chat"}
    cluster.wait_node_state(old_node, "LOST", timeout=30)

    def moved() -> dict[str, Any] | None:
        ready = [
            r for r in cluster.replicas("chat") if r["state"] == "ready" and r["nodes"] == [other]
        ]
        return ready[0] if ready else None

    from llmgw_testkit import wait_for

    replica = wait_for(moved, timeout=60, what=f"chat ready again on {other}")
    assert replica["replica_id"] != first["replica_id"] or replica["nodes"] != first["nodes"]
    cluster.wait_router_models("chat")

    # Now lose the other node too: nowhere left, and explain says why.
    cluster.agents[other].stop(signal.SIGKILL)
    cluster.wait_node_state(other, "LOST", timeout=40)
    wait_for(
        lambda: any(r["state"] in ("unplaced", "backoff") for r in cluster.replicas("chat")),
        timeout=30,
        what="chat unplaceable",
    )

    def explained() -> str | None:
        text = explain(cluster, "chat")
        return text if "lost" in text else None

    text = wait_for(explained, timeout=30, what="explain naming the lost nodes")
    assert "0 of 2 nodes fit" in text
    assert "2 are lost" in text or "lost (gpu-a, gpu-b)" in text, text
