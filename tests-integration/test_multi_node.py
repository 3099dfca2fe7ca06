"""Scenario 7: a two-node replica lands on nodes that share its fabric label, and only the
leader's endpoint is published."""

from __future__ import annotations

import json
import urllib.request

import openai
from llmgw_testkit.cluster import Cluster, vllm_profile


def cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode() for a in f.read().split(b"\0") if a]


def test_two_node_replica_shares_the_fabric_label_and_publishes_its_leader(
    cluster: Cluster,
) -> None:
    profile = vllm_profile(gpus=2, nodes=2, same_label="fabric.ib-subnet")
    cluster.start_control([{"name": "big", "profiles": {"default": profile}}])
    # gpu-b has the most room but sits on another subnet: only a and c can pair.
    cluster.start_agent("gpu-a", gpus=2, labels={"fabric.ib-subnet": "ib-1"})
    cluster.start_agent("gpu-b", gpus=8, labels={"fabric.ib-subnet": "ib-2"})
    cluster.start_agent("gpu-c", gpus=2, labels={"fabric.ib-subnet": "ib-1"})
    cluster.start_router()

    (replica,) = cluster.wait_replicas("big", 1)
    assert sorted(replica["nodes"]) == ["gpu-a", "gpu-c"]
    shards = sorted(replica["shards"], key=lambda s: s["rank"])
    leader, follower = shards
    assert leader["rank"] == 0
    assert follower["rank"] == 1

    lead_argv = cmdline(leader["pid"])
    follow_argv = cmdline(follower["pid"])
    assert "--headless" not in lead_argv
    assert "--headless" in follow_argv
    assert follow_argv[follow_argv.index("--node-rank") + 1] == "1"
    assert follow_argv[follow_argv.index("--nnodes") + 1] == "2"
    master = lead_argv[lead_argv.index("--master-port") + 1]
    assert follow_argv[follow_argv.index("--master-port") + 1] == master
    assert follow_argv[follow_argv.index("--master-addr") + 1] == "127.0.0.1"

    assert replica["endpoint"] == f"http://127.0.0.1:{leader['port']}"
    cluster.wait_router_models("big")
    url = f"http://127.0.0.1:{cluster.router_admin_port}/v1/endpoints"
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.loads(resp.read())
    published = body["endpoints"] if isinstance(body, dict) else body
    assert [e["url"] for e in published] == [replica["endpoint"]]

    client = openai.OpenAI(base_url=f"{cluster.router_url}/v1", api_key="x", max_retries=0)
    reply = client.completions.create(model="big", prompt="Once upon a time", max_tokens=6)
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 6
