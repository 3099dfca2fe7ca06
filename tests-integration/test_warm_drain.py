"""Issue 28 point 3: a drain that keeps the cache warm, the whole chain as real processes.

A model scaled from two replicas to one: the control plane publishes the replica it takes
away as leaving for `warm_before_drain` before it drains it; the router then sends the
replica that stays one-token copies of the prompts it sent the leaving one, and every new
request goes to the one that stays.
"""

from __future__ import annotations

import json
import signal
import urllib.request

import httpx
from llmgw_testkit import wait_for
from llmgw_testkit.cluster import Cluster, metric_sum, vllm_profile


def engine_metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        return metric_sum(resp.read().decode(), name)


def router_metric(cluster: Cluster, name: str, **labels: str) -> float:
    return metric_sum(cluster.router_metrics(), name, **labels)


def router_slots(cluster: Cluster) -> dict[str, str]:
    """Each endpoint's slot as the router's admin view shows it (Endpoint.slot)."""
    url = f"http://127.0.0.1:{cluster.router_admin_port}/v1/endpoints"
    return {e["id"]: e["slot"] for e in httpx.get(url, timeout=5).json()["endpoints"]}


def prompt(i: int) -> str:
    return f"tenant {i:03d} shares this system prompt. " + ("lorem ipsum dolor sit amet " * 60)


def test_scale_down_warms_the_replica_that_inherits(cluster: Cluster) -> None:
    # Long enough for the router to act on the mark, short for the suite.
    cluster.timings["warm_before_drain"] = "4s"
    models = [{"name": "chat", "profiles": {"default": vllm_profile(gpus=1, replicas=2)}}]
    cluster.start_control(models)
    cluster.start_agent("gpu-a", gpus=2)
    cluster.start_router()
    replicas = cluster.wait_replicas("chat", 2)
    urls = {r["replica_id"]: r["endpoint"] for r in replicas}
    cluster.wait_router_models("chat")

    with httpx.Client(timeout=60) as http:
        for _ in range(3):
            for i in range(16):
                r = http.post(
                    cluster.router_url + "/v1/completions",
                    json={"model": "chat", "prompt": prompt(i), "max_tokens": 2},
                )
                assert r.status_code == 200, r.text
        served = {
            rid: engine_metric(url, "vllm:request_success_total") for rid, url in urls.items()
        }
        assert all(n > 0 for n in served.values()), served
        generated = {
            rid: engine_metric(url, "vllm:generation_tokens_total") for rid, url in urls.items()
        }

        config_path = cluster.workdir / "control.yaml"
        config = json.loads(config_path.read_text())
        config["models"][0]["profiles"]["default"]["replicas"] = 1
        config_path.write_text(json.dumps(config, indent=2))
        assert cluster.control is not None
        cluster.control.signal(signal.SIGHUP)

        # The router warms the heir while the leaving replica is still published.
        wait_for(
            lambda: router_metric(cluster, "llmgw_router_warm_requests_total") >= 1,
            timeout=60,
            what="warm requests sent",
        )
        (removed,) = [r for r in cluster.replicas("chat") if r["state"] == "draining"]
        (kept,) = [rid for rid in urls if rid != removed["replica_id"]]
        warm = router_metric(cluster, "llmgw_router_warm_requests_total", outcome="ok")
        assert warm >= 1
        # One token each, at the heir only.
        wait_for(
            lambda: (
                engine_metric(urls[kept], "vllm:generation_tokens_total") == generated[kept] + warm
            ),
            timeout=30,
            what="warm requests answered by the heir",
        )
        assert (
            engine_metric(urls[removed["replica_id"]], "vllm:generation_tokens_total")
            == generated[removed["replica_id"]]
        )
        # Bounded: at most a tenth of the prompt tokens this router sent lately, all told.
        sent = sum(len(prompt(i)) // 4 for i in range(16)) * 3
        assert router_metric(cluster, "llmgw_router_warm_prompt_tokens_total") <= 0.1 * sent

        # New requests go to the heir, the leaving replica's prompts included.
        before = engine_metric(urls[kept], "vllm:request_success_total")
        for i in range(16):
            r = http.post(
                cluster.router_url + "/v1/completions",
                json={"model": "chat", "prompt": prompt(i), "max_tokens": 2},
            )
            assert r.status_code == 200, r.text
        assert engine_metric(urls[kept], "vllm:request_success_total") == before + 16

    wait_for(lambda: len(cluster.replicas("chat")) == 1, timeout=60, what="one replica left")


def test_a_rolling_update_warms_each_new_replica_before_it_takes_its_prefixes(
    cluster: Cluster,
) -> None:
    """Two replicas roll to a new revision one at a time (max_surge 1, min_ready 15 s):
    the first new replica takes the slot of the old one retired for it (Endpoint.slot,
    as the router sees it), is sent one-token copies of the prompts whose home it becomes
    (the leaving replica's) before it takes them, so every request it then serves hits
    its cache (without warming they move to it cold); and the next new replica waits
    until it has been ready for min_ready."""
    cluster.timings["warm_before_drain"] = "4s"
    rollout = {"max_surge": 1, "max_unavailable": 0, "min_ready": "15s"}
    profile = vllm_profile(gpus=1, replicas=2, rollout=rollout)
    cluster.start_control([{"name": "chat", "profiles": {"default": profile}}])
    cluster.start_agent("gpu-a", gpus=3)
    cluster.start_router(warming={"max_prefill_fraction": 1.0, "max_requests": 64})
    old = {r["replica_id"] for r in cluster.wait_replicas("chat", 2)}
    cluster.wait_router_models("chat")

    def both() -> dict[str, str] | None:
        seen = router_slots(cluster)
        return seen if set(seen) == old else None

    slots = wait_for(both, timeout=30, what="the router's view of both replicas")
    assert sorted(slots.values()) == ["chat/default/0", "chat/default/1"]

    with httpx.Client(timeout=60) as http:

        def send(i: int) -> None:
            r = http.post(
                cluster.router_url + "/v1/completions",
                json={"model": "chat", "prompt": prompt(i), "max_tokens": 2},
            )
            assert r.status_code == 200, r.text

        for _ in range(3):
            for i in range(16):
                send(i)

        config_path = cluster.workdir / "control.yaml"
        config = json.loads(config_path.read_text())
        config["models"][0]["profiles"]["default"]["env"]["LLMGW_SIM_REVISION"] = "2"
        config_path.write_text(json.dumps(config, indent=2))
        assert cluster.control is not None
        cluster.control.signal(signal.SIGHUP)

        def first_new() -> str | None:
            for r in cluster.replicas("chat"):
                if r["replica_id"] not in old and r["state"] == "ready":
                    return str(r["endpoint"])
            return None

        url = wait_for(first_new, timeout=60, what="the first new replica ready")
        (new_id,) = [r["replica_id"] for r in cluster.replicas("chat") if r["endpoint"] == url]
        new_slot = wait_for(
            lambda: router_slots(cluster).get(new_id), timeout=30, what="the router's new one"
        )
        # It took the slot of the old replica retired for it, and that one is leaving.
        (predecessor,) = [rid for rid, s in slots.items() if s == new_slot]
        wait_for(
            lambda: all(
                r["state"] == "draining"
                for r in cluster.replicas("chat")
                if r["replica_id"] == predecessor
            ),
            timeout=30,
            what="its predecessor retired",
        )
        # The other old replica serves on.
        (other,) = old - {predecessor}
        assert [r["state"] for r in cluster.replicas("chat") if r["replica_id"] == other] == [
            "ready"
        ]
        wait_for(
            lambda: router_metric(cluster, "llmgw_router_warm_requests_total") >= 1,
            timeout=30,
            what="warm requests sent",
        )
        # The next new replica waits: the first has been ready for less than min_ready.
        wait_for(
            lambda: any(
                "min_ready" in str(r.get("reason", "")) for r in cluster.status()["rollouts"]
            ),
            timeout=30,
            what="the rollout waiting for min_ready",
        )
        served = 0
        cold: list[int] = []

        def a_round_served_by_the_new_replica() -> bool:
            nonlocal served
            for i in range(16):
                hits = engine_metric(url, "vllm:prefix_cache_hits_total")
                queries = engine_metric(url, "vllm:prefix_cache_queries_total")
                send(i)
                asked = engine_metric(url, "vllm:prefix_cache_queries_total") - queries
                if asked > 0:
                    served += 1
                    if engine_metric(url, "vllm:prefix_cache_hits_total") - hits < 0.8 * asked:
                        cold.append(i)
            return served > 0

        wait_for(a_round_served_by_the_new_replica, timeout=60, what="a request on the new one")
        assert not cold, f"prompts {cold} missed the new replica's cache"
        # The copies were one token each and all answered.
        warm = router_metric(cluster, "llmgw_router_warm_requests_total", outcome="ok")
        assert warm == router_metric(cluster, "llmgw_router_warm_requests_total")
