"""Issue 17.2: replicas follow a 3x load step on the engines' reported load, and come back.

Real control plane, agent (reading the simulated engines' metrics into load reports),
router and the official openai client. `replicas: {min: 1, max: 3}` with a target of
one waiting request per replica: three times the load one replica takes without a
queue makes requests wait; the control plane scales up once the target has been
exceeded for `up_after`, and back down by drain after `down_after` without load. At
most 1 % of requests may fail while it does.
"""

from __future__ import annotations

import threading

import openai
from llmgw_testkit import wait_for
from llmgw_testkit.cluster import Cluster, vllm_profile


def test_replicas_follow_a_load_step(cluster: Cluster) -> None:
    profile = vllm_profile(
        replicas={"min": 1, "max": 3},
        args=["--max-num-seqs", "2"],
        env={"LLMGW_SIM_ITL": "0.03"},
        autoscale={"metric": "waiting", "target": 1, "up_after": "1s", "down_after": "3s"},
    )
    cluster.timings["load_interval"] = "200ms"
    cluster.start_control([{"name": "chat", "profiles": {"default": profile}}])
    cluster.start_agent("gpu-a", gpus=3)
    cluster.start_router(balancer="least_outstanding")
    cluster.wait_replicas("chat", 1, timeout=90)
    cluster.wait_router_models("chat")

    client = openai.OpenAI(
        base_url=f"{cluster.router_url}/v1", api_key="x", max_retries=0, timeout=120
    )
    ok: list[int] = []
    failed: list[str] = []
    stop = threading.Event()

    def user() -> None:
        while not stop.is_set():
            try:
                client.completions.create(model="chat", prompt="load", max_tokens=30)
                ok.append(1)
            except Exception as err:
                failed.append(repr(err))

    # Two requests fill the one replica's batch (max-num-seqs 2); seven queue up. The
    # nine held need three replicas (each running 2 with at most 1 waiting); two would
    # leave 2.5 waiting each, above the target, so it neither stops at two nor drains.
    users = [threading.Thread(target=user) for _ in range(9)]
    for t in users:
        t.start()
    try:
        grown = cluster.wait_replicas("chat", 3, timeout=120)
        assert len(grown) >= 3
        scaling = next(s for s in cluster.status()["scaling"] if s["model"] == "chat")
        assert scaling["wanted"] == 3
        assert scaling["max"] == 3
    finally:
        stop.set()
        for t in users:
            t.join(timeout=120)
    # Load gone: down by drain, one at a time, to the minimum.
    wait_for(
        lambda: len([r for r in cluster.replicas("chat") if r["state"] != "draining"]) == 1,
        timeout=120,
        what="back to one replica",
    )
    total = len(ok) + len(failed)
    assert total >= len(users)
    assert len(failed) <= total // 100, failed[:5]
