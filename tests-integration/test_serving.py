"""Scenario 1: agents register, replicas are placed and launched, the router serves them."""

from __future__ import annotations

from pathlib import Path

import openai
from llmgw_testkit.checks import stream_chat_with_usage
from llmgw_testkit.cluster import Cluster, vllm_profile


def test_register_place_launch_and_stream_through_the_router(cluster: Cluster) -> None:
    cluster.start_control(
        [{"name": "chat", "profiles": {"default": vllm_profile(gpus=2, replicas=2)}}]
    )
    labels = {"fabric.nvlink-domain": "nvl-1", "fabric.ib-subnet": "ib-7", "zone": "a"}
    cluster.start_agent("gpu-a", gpus=8, labels=labels)
    cluster.start_agent(
        "gpu-b", gpus=4, labels={"fabric.nvlink-domain": "nvl-2", "fabric.ib-subnet": "ib-7"}
    )
    cluster.start_router()

    # Registration carried the whole inventory and the fabric labels.
    node = cluster.wait_node_state("gpu-a", "READY")
    assert node["labels"] == labels
    assert node["simulated"] is True
    assert [g["index"] for g in node["gpus"]] == list(range(8))
    assert {g["name"] for g in node["gpus"]} == {"NVIDIA H200"}
    assert len(cluster.wait_node_state("gpu-b", "READY")["gpus"]) == 4

    replicas = cluster.wait_replicas("chat", 2)
    for replica in replicas:
        (shard,) = replica["shards"]
        assert len(shard["gpu_indices"]) == 2
        assert shard["pid"] > 0
        # The engine runs the command line the vLLM adapter built.
        cmdline = Path(f"/proc/{shard['pid']}/cmdline").read_bytes().split(b"\0")
        assert b"serve" in cmdline
        assert cmdline[cmdline.index(b"--tensor-parallel-size") + 1] == b"2"
        assert cmdline[cmdline.index(b"--port") + 1] == str(shard["port"]).encode()
        environ = Path(f"/proc/{shard['pid']}/environ").read_bytes().split(b"\0")
        visible = ",".join(str(i) for i in shard["gpu_indices"]).encode()
        assert b"CUDA_VISIBLE_DEVICES=" + visible in environ

    cluster.wait_router_models("chat")
    got = stream_chat_with_usage(
        cluster.router_url, "chat", max_tokens=12, content="Say something.", api_key="unused"
    )
    assert got.text
    usage = got.usage
    assert usage.completion_tokens == 12
    assert usage.prompt_tokens > 0

    client = openai.OpenAI(base_url=f"{cluster.router_url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=5
    )
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 5
