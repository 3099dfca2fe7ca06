"""SIGHUP on the agent (issue 29 point 9) is harmless: logged, nothing else. Before, its
default action ended the agent (exit 129) while the other two programs reload on it."""

from __future__ import annotations

import signal

from llmgw_testkit.cluster import Cluster, vllm_profile


def test_sighup_leaves_the_agent_and_its_engine_running(cluster: Cluster) -> None:
    cluster.start_control([{"name": "chat", "profiles": {"default": vllm_profile(gpus=1)}}])
    agent = cluster.start_agent("gpu-a", gpus=2)
    (before,) = cluster.wait_replicas("chat", 1)
    agent.signal(signal.SIGHUP)
    # Fails at once, with the agent's last lines, if the agent died of it.
    agent.wait_output("SIGHUP: the agent reads its config only at start", timeout=30)
    assert agent.alive(), agent.tail()
    # Still registered, the same engine still ready.
    assert cluster.node("gpu-a")["state"] == "READY"  # type: ignore[index]
    (after,) = cluster.wait_replicas("chat", 1)
    assert after["replica_id"] == before["replica_id"]
    assert [s["pid"] for s in after["shards"]] == [s["pid"] for s in before["shards"]]
