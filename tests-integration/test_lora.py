"""Issue 30: LoRA adapters, loaded where requests want them and routed to where they are.

Real control plane, agent, simulated vLLM engines (runtime LoRA as vLLM serves it) and
router; the official openai client. Two replicas of one base model that each hold one
adapter at once, three adapters. The router lists the adapters with their base model as
parent; a request for an adapter no engine holds is held, the control plane loads it on
a replica, and the request is answered; later requests go to the holder (a replica
without it would answer 404, as vLLM does); a third adapter on full engines unloads the
least recently used one. The same on simulated SGLang engines, which take the adapter
from the body's ``lora_path`` (the router sets it) and answer any model name with the
base model.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import openai
import pytest
from llmgw_control.cli import render_status
from llmgw_testkit import wait_for
from llmgw_testkit.cluster import Cluster, vllm_profile

ADAPTERS = ["sql", "chat", "poem"]


def _lora(cluster: Cluster) -> dict[str, Any]:
    status: dict[str, Any] = cluster.status()["lora"]
    return status


def _holders(cluster: Cluster, adapter: str) -> list[str]:
    holders: list[str] = _lora(cluster)["adapters"][adapter]["holders"]
    return holders


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_adapters_listed_loaded_on_demand_routed_to_holders_and_evicted(
    cluster: Cluster, engine: str
) -> None:
    profile = vllm_profile(
        replicas=2,
        # Unused for 1 s before it may be unloaded: the router reports use every 200 ms.
        lora={"max_loras": 1, "max_rank": 16, "min_idle": "1s"},
        env={"LLMGW_SIM_LORA_LOAD_TIME": "0.2"},
    )
    # SGLang answers any model name with its base model and takes the adapter from the
    # body's lora_path, which the router sets (and removes from a base model's request).
    profile["engine"] = engine
    model = {
        "name": "base",
        "profiles": {"default": profile},
        "adapters": [{"name": a, "source": f"/loras/{a}"} for a in ADAPTERS],
    }
    cluster.start_control([model])
    cluster.start_agent("gpu-a", gpus=2)
    cluster.start_router(hold={"hold_timeout": "60s", "demand_interval": "200ms"})
    cluster.wait_replicas("base", 2, timeout=90)
    cluster.wait_router_models("base", *ADAPTERS)

    # /v1/models: each adapter with its base model as parent.
    with urllib.request.urlopen(f"{cluster.router_url}/v1/models", timeout=10) as r:
        listed = {m["id"]: m for m in json.loads(r.read())["data"]}
    assert {a: listed[a]["parent"] for a in ADAPTERS} == dict.fromkeys(ADAPTERS, "base")

    client = openai.OpenAI(
        base_url=f"{cluster.router_url}/v1", api_key="x", max_retries=0, timeout=90
    )

    def answer(model: str, **extra: Any) -> str:
        out = client.completions.create(model=model, prompt="hello", max_tokens=3, **extra)
        assert out.model == model
        text: str = out.choices[0].text
        return text

    # The base model's answer; an adapter answers differently (each engine is greedy).
    base = answer("base")
    answers: dict[str, str] = {}

    def ask(adapter: str) -> str:
        text = answer(adapter)
        assert text != base, f"{adapter} was answered by the base model"
        assert answers.setdefault(adapter, text) == text
        return text

    # No engine holds it: held at the router, loaded by the control plane, answered.
    assert _holders(cluster, "sql") == []
    assert ask("sql")
    wait_for(lambda: _holders(cluster, "sql"), timeout=30, what="sql held by a replica")
    (sql_holder,) = _holders(cluster, "sql")

    # Routed to the holder: every request is answered (the other replica would say 404),
    # and nothing more is loaded for them.
    for _ in range(8):
        assert ask("sql")
    assert _lora(cluster)["loads"] == 1
    assert _holders(cluster, "sql") == [sql_holder]
    # A client's own lora_path (SGLang's field) chooses nothing: the model does.
    for _ in range(4):
        assert answer("base", extra_body={"lora_path": "sql"}) == base

    # A second adapter goes to the replica with a free slot.
    assert ask("chat")
    wait_for(lambda: _holders(cluster, "chat"), timeout=30, what="chat held")
    (chat_holder,) = _holders(cluster, "chat")
    assert chat_holder != sql_holder

    # A third, with both engines full: the least recently used (sql) is unloaded for it.
    assert ask("poem")
    wait_for(
        lambda: _holders(cluster, "poem") and not _holders(cluster, "sql"),
        timeout=30,
        what="poem loaded where sql was unloaded",
    )
    assert _holders(cluster, "poem") == [sql_holder]
    assert _holders(cluster, "chat") == [chat_holder]
    status = _lora(cluster)
    assert status["loads"] == 3
    assert status["unloads"] == 1
    assert status["load_failures"] == 0
    # `llmgw-control status` shows them.
    text = render_status(cluster.status())
    assert "ADAPTER" in text
    assert "adapter loads 3 (0 failed), unloads 1 (0 failed)" in text
    metrics = cluster.metrics()
    assert (
        'llmgw_control_adapter_commands_total{kind="unload",model="base",result="ok"} 1.0'
        in metrics
    )
