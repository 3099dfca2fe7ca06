"""Issue 32: a disaggregated profile's prefill and decode pools on one fabric, their engines
launched with the NIXL connector, and a chat completion through the router going to a
prefill engine and then a decode engine (the simulators speak vLLM's protocol and sign
what they issue: llmgw_sim.kvtransfer); params no prefill engine issued are refused, and a
prefill engine's failure is retried on another. One fleet, real processes throughout."""

from __future__ import annotations

import json
from typing import Any

import httpx
from llmgw_testkit.cluster import Cluster, vllm_profile

LABEL = "fabric.ib-subnet"


def cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode() for a in f.read().split(b"\0") if a]


def environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [a.decode().partition("=") for a in f.read().split(b"\0") if a]
    return {k: v for k, _, v in pairs}


def kv(url: str) -> dict[str, int]:
    return dict(httpx.get(url + "/sim/kv", timeout=5).json())


def test_pd_pools_on_one_fabric_prefill_then_decode(cluster: Cluster) -> None:
    profile = vllm_profile(
        env={"LLMGW_SIM_SCRIPT_ROUTES": "1"},
        fabric_label=LABEL,
        prefill={"replicas": 2, "gpus_per_node": 1},
        decode={"replicas": 1, "gpus_per_node": 1},
    )
    profile.pop("replicas")
    cluster.start_control([{"name": "m", "profiles": {"pd": profile}}])
    # ib-2 has a node with room for two, not three: both pools go to ib-1's two nodes.
    cluster.start_agent("gpu-a", gpus=2, labels={LABEL: "ib-1"})
    cluster.start_agent("gpu-b", gpus=2, labels={LABEL: "ib-2"})
    cluster.start_agent("gpu-c", gpus=2, labels={LABEL: "ib-1"})
    cluster.start_router()

    replicas = cluster.wait_replicas("m", 3, timeout=90)
    by_profile: dict[str, list[dict[str, Any]]] = {}
    for rep in replicas:
        by_profile.setdefault(rep["profile"], []).append(rep)
        assert set(rep["nodes"]) <= {"gpu-a", "gpu-c"}, rep
    assert sorted((p, len(rs)) for p, rs in by_profile.items()) == [
        ("pd-decode", 1),
        ("pd-prefill", 2),
    ]
    for rep in replicas:
        (shard,) = rep["shards"]
        argv, env = cmdline(shard["pid"]), environ(shard["pid"])
        config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        kv_role = "kv_producer" if rep["profile"] == "pd-prefill" else "kv_consumer"
        assert config == {"kv_connector": "NixlConnector", "kv_role": kv_role}
        side = int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
        assert side != shard["port"]
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    prefill = [rep["endpoint"] for rep in by_profile["pd-prefill"]]
    (decode_replica,) = by_profile["pd-decode"]
    decode = decode_replica["endpoint"]

    cluster.wait_router_models("m")
    chat = {"model": "m", "messages": [{"role": "user", "content": "Hello there"}]}
    r = httpx.post(
        f"{cluster.router_url}/v1/chat/completions", json={**chat, "max_tokens": 8}, timeout=30
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    assert sum(kv(url)["kv_issued"] for url in prefill) == 1
    assert kv(decode)["kv_received"] == 1

    # Params no prefill engine issued, sent to the decode engine with its own key.
    key = environ(decode_replica["shards"][0]["pid"]).get("VLLM_API_KEY", "")
    forged = {"do_remote_prefill": True, "remote_engine_id": "x", "sim_signature": "0" * 64}
    refused = httpx.post(
        decode + "/v1/chat/completions",
        json={**chat, "kv_transfer_params": forged},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert refused.status_code == 400, refused.text
    assert "not issued by a prefill engine" in refused.text
    assert kv(decode)["kv_refused"] == 1

    # Each prefill engine fails its next request: the router goes on to the other, then
    # each again, and the answer still comes.
    for url in prefill:
        httpx.post(url + "/sim/script", json={"status": 500, "count": 1}, timeout=5)
    r = httpx.post(
        f"{cluster.router_url}/v1/chat/completions", json={**chat, "max_tokens": 4}, timeout=30
    )
    assert r.status_code == 200, r.text
    assert sum(kv(url)["kv_issued"] for url in prefill) == 2
    assert kv(decode)["kv_received"] == 2
