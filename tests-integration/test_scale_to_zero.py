"""Issue 17.3: a model with `replicas: {min: 0}` starts on demand and goes back to zero.

Real control plane, agent, simulated vLLM engine and router; the official openai client.
The router lists the model while it has no replica, holds the requests it gets for it,
tells the control plane (ReportDemand), and answers them once the first replica is
READY. With nothing more to do the model goes back to zero after `idle_after`. A request
held past `hold_timeout` gets 503 with Retry-After.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import openai
import pytest
from llmgw_testkit import wait_for
from llmgw_testkit.cluster import Cluster, vllm_profile

HELD = 20


def test_zero_to_one_answers_every_held_request_then_back_to_zero(cluster: Cluster) -> None:
    profile = vllm_profile(replicas={"min": 0, "max": 1}, idle_after="4s")
    cluster.start_control([{"name": "cold", "profiles": {"default": profile}}])
    cluster.start_agent("gpu-a", gpus=1)
    cluster.start_router(hold={"hold_timeout": "90s", "max_held": 64})
    # Declared at zero replicas, so clients see it.
    cluster.wait_router_models("cold")
    assert cluster.replicas("cold") == []

    client = openai.OpenAI(
        base_url=f"{cluster.router_url}/v1", api_key="x", max_retries=0, timeout=120
    )
    answers: list[str] = []
    errors: list[str] = []

    def ask() -> None:
        try:
            out = client.completions.create(model="cold", prompt="wake up", max_tokens=3)
            answers.append(out.choices[0].text)
        except Exception as err:
            errors.append(repr(err))

    threads = [threading.Thread(target=ask) for _ in range(HELD)]
    for t in threads:
        t.start()
    cluster.wait_replicas("cold", 1, timeout=90)
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert len(answers) == HELD
    assert all(answers)

    # Idle (no requests, no demand) for idle_after: drained back to zero.
    wait_for(lambda: cluster.replicas("cold") == [], timeout=90, what="back to zero replicas")
    scaling = [s for s in cluster.status()["scaling"] if s["model"] == "cold"]
    assert scaling
    assert scaling[0]["wanted"] == 0
    assert "cold" in cluster.router_models()


def test_hold_timeout_answers_503_with_retry_after(cluster: Cluster) -> None:
    # Needs more GPUs than any node has: its first replica never comes.
    profile = vllm_profile(gpus=4, replicas={"min": 0, "max": 1})
    cluster.start_control([{"name": "never", "profiles": {"default": profile}}])
    cluster.start_agent("gpu-a", gpus=1)
    cluster.start_router(hold={"hold_timeout": "2s"})
    cluster.wait_router_models("never")
    request = urllib.request.Request(
        f"{cluster.router_url}/v1/completions",
        data=json.dumps({"model": "never", "prompt": "hi", "max_tokens": 2}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    err = info.value
    assert err.code == 503
    assert err.headers.get("Retry-After")
    body = json.loads(err.read())
    assert body["error"]["message"]
    # The control plane heard the demand and says why it cannot act on it.
    explained = cluster.admin("/v1/explain/never")
    (entry,) = explained["profiles"]
    assert entry["wanted"] == 1
    assert "wants 1, has 0: 0 of 1 nodes fit" in entry.get("summary", ""), entry
