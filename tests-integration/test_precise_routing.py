"""Issue 15.3 end to end on simulated vLLM engines: precise prefix matching.

Two simulated vLLM replicas with a real (word-level) tokenizer publish KV-cache events
carrying each block's token ids; the agent names the blocks by those ids and relays them
through the control plane; the router, given the same tokenizer folder, tokenizes each
prompt and matches it against what each engine reports cached. A conversation sent again
by another client (other JSON key order and spacing: other bytes, the same tokens) goes
to the engine that holds it. The same checks on a real vLLM are in tests-real-vllm.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import httpx
from llmgw_testkit import wait_for
from llmgw_testkit.cluster import Cluster, metric_sum, vllm_profile
from llmgw_testkit.tokenizer import write_word_tokenizer

WORDS = [f"w{i}" for i in range(300)] + ["why", "how", "when"]


def _match(cluster: Cluster, body: dict[str, Any]) -> dict[str, Any]:
    url = f"http://127.0.0.1:{cluster.router_admin_port}/v1/match"
    answer: dict[str, Any] = httpx.post(url, json=body, timeout=10).json()
    return answer


def _served(url: str) -> float:
    return metric_sum(httpx.get(f"{url}/metrics", timeout=5).text, "vllm:request_success_total")


def test_a_prompt_goes_to_the_engine_that_reports_it_cached(
    cluster: Cluster, tmp_path: Path
) -> None:
    folder = write_word_tokenizer(tmp_path / "tokenizer", WORDS)
    cluster.timings["load_interval"] = "250ms"
    # Port 0: the agent gives each engine of the profile its own events port.
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0"}
    profile = vllm_profile(
        replicas=2,
        args=[
            "--block-size",
            "16",
            "--tokenizer",
            str(folder),
            "--kv-events-config",
            json.dumps(events),
        ],
        env={"LLMGW_SIM_SCHEDULER": "step"},
    )
    cluster.start_control([{"name": "chat", "profiles": {"default": profile}}])
    cluster.start_agent("gpu-a", gpus=2)
    cluster.start_router(cache_aware={"tokenizers": {"chat": str(folder)}})
    cluster.wait_replicas("chat", 2, timeout=90)
    cluster.wait_router_models("chat")

    # An engine's events published before the agent's subscription has joined are lost
    # (ZeroMQ's slow joiner: the agent subscribes as the engine comes up, and a loaded
    # machine can serve the first request sooner): a prompt whose blocks no engine reports
    # within a while is followed by another of other words.
    holder: dict[str, Any] | None = None
    for shift in range(0, 100, 20):
        system = " ".join(f"w{i}" for i in range(shift, shift + 200))
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "why"}]
        body = {"model": "chat", "messages": messages, "max_tokens": 2}
        # The router's count: BOS, the template's role markers, 200 + 1 words.
        before = _match(cluster, body)
        assert before["prompt_tokens"] == 1 + 1 + 200 + 1 + 1 + 1
        assert all(ep["cached_blocks"] in (-1, 0) for ep in before["endpoints"])
        reply = httpx.post(f"{cluster.router_url}/v1/chat/completions", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        full = before["prompt_tokens"] // 16

        def held(body: dict[str, Any] = body, full: int = full) -> dict[str, Any] | None:
            eps = _match(cluster, body)["endpoints"]
            holders = [ep for ep in eps if ep["cached_blocks"] == full]
            return holders[0] if len(holders) == 1 else None

        with contextlib.suppress(TimeoutError):
            holder = wait_for(held, timeout=15, what=f"one engine reporting all {full} blocks")
        if holder is not None:
            break
    assert holder is not None, "no engine reported a prompt's blocks cached, five prompts running"
    assert holder["token_block_size"] == 16
    view = httpx.get(f"http://127.0.0.1:{cluster.router_admin_port}/v1/endpoints", timeout=5)
    urls = {ep["id"]: ep["url"] for ep in view.json()["endpoints"]}
    served = {eid: _served(url) for eid, url in urls.items()}

    # Another client: keys in another order, other spacing. Other bytes, same tokens.
    for question in ("why", "why", "why"):
        raw = (
            '{ "max_tokens" : 2 , "messages" : [ { "content" : '
            + json.dumps(system)
            + ' , "role" : "system" } , { "content" : "'
            + question
            + '", "role" : "user" } ] , "model" : "chat" }'
        )
        reply = httpx.post(
            f"{cluster.router_url}/v1/chat/completions",
            content=raw.encode(),
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text
    after = {eid: _served(url) for eid, url in urls.items()}
    assert after[holder["id"]] - served[holder["id"]] == 3
    assert sum(after.values()) - sum(served.values()) == 3
    picks = view.json()["engine_cache_picks"]
    final = httpx.get(f"http://127.0.0.1:{cluster.router_admin_port}/v1/endpoints", timeout=5)
    assert final.json()["engine_cache_picks"] >= picks + 3
    for ep in final.json()["endpoints"]:
        assert ep["token_block_size"] in (16, None)
