"""Issue 31 across the whole system (control plane, agent, simulated engines, router,
real processes over mTLS):

- a replica's start is one trace in a real OTLP receiver: the control plane's placement
  and send, the agent's validation, launch and load until READY, and the control plane's
  span for each of the agent's status messages, linked through the traceparents the
  StartShard and ShardStatus messages carry;
- which routes each replica serves is read by the agent (the simulator's /openapi.json
  for vLLM, llama-server's known routes), relayed in the Endpoint, and a route no
  replica of the model serves is a 404 in OpenAI's shape naming the route and the model.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from llmgw_testkit import wait_for
from llmgw_testkit.cluster import Cluster, vllm_profile
from llmgw_testkit.otlp import OtlpReceiver, Span


def _start_trace(otlp: OtlpReceiver) -> dict[str, Span]:
    """The spans of the trace that holds an agent.load, once its READY status is in."""

    def complete(spans: list[Span]) -> bool:
        ready = [
            s
            for s in spans
            if s.name == "control.shard_status" and s.attributes.get("state") == "READY"
        ]
        if not ready:
            return False
        names = {s.name for s in spans if s.trace_id == ready[0].trace_id}
        return {
            "control.place",
            "control.send_start",
            "agent.start_shard",
            "agent.validate",
            "agent.launch",
            "agent.load",
        } <= names

    spans = otlp.wait_for_spans(complete, timeout=120, what="a replica's start trace")
    ready = next(
        s
        for s in spans
        if s.name == "control.shard_status" and s.attributes.get("state") == "READY"
    )
    in_trace = [s for s in spans if s.trace_id == ready.trace_id]
    by_name: dict[str, Span] = {}
    for s in in_trace:
        by_name.setdefault(s.name, s)
    by_name["ready"] = ready
    return by_name


def test_a_replica_start_is_one_trace(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every process exports every 100 ms, not every 5 s.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    with OtlpReceiver() as otlp:
        cluster.control_extra["tracing"] = {"endpoint": otlp.url}
        cluster.start_control([{"name": "chat", "profiles": {"default": vllm_profile(gpus=1)}}])
        cluster.start_agent("gpu-a", gpus=1, tracing={"endpoint": otlp.url})
        spans = _start_trace(otlp)
        place, send = spans["control.place"], spans["control.send_start"]
        start, load = spans["agent.start_shard"], spans["agent.load"]
        assert place.service == "llmgw-control"
        assert start.service == "llmgw-agent"
        assert place.parent_id == ""
        assert send.parent_id == place.span_id
        # Across the stream: the agent's start is the child of the control plane's send.
        assert start.parent_id == send.span_id
        assert spans["agent.validate"].parent_id == start.span_id
        assert spans["agent.launch"].parent_id == start.span_id
        assert load.parent_id == start.span_id
        # ... and the control plane's READY span the child of the agent's load.
        assert spans["ready"].parent_id == load.span_id
        assert place.attributes["model"] == "chat"
        assert place.attributes["node"] == "gpu-a"
        assert start.attributes["shard"] == place.attributes["shard"]
        assert load.attributes["outcome"] == "ready"
        assert load.attributes["routes"] > 0
        assert load.end_ns - load.start_ns > 0


def test_routes_are_known_and_an_unserved_one_is_a_404(cluster: Cluster, tmp_path: Path) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    llama = {
        "engine": "llamacpp",
        "model_ref": str(gguf),
        "gpus_per_node": 0,
        "replicas": 1,
        "load_timeout": "60s",
        "env": {"LLMGW_SIM_ITL": "0.005", "LLMGW_SIM_LOAD_TIME": "0.3"},
    }
    cluster.start_control(
        [
            {"name": "chat", "profiles": {"default": vllm_profile(gpus=1)}},
            {"name": "tiny", "profiles": {"default": llama}},
        ]
    )
    cluster.start_agent("gpu-a", gpus=1)
    cluster.start_router()
    cluster.wait_router_models("chat", "tiny", timeout=120)

    def routes_known() -> bool:
        eps = httpx.get(
            f"http://127.0.0.1:{cluster.router_admin_port}/v1/endpoints", timeout=5
        ).json()
        return len(eps["endpoints"]) == 2

    wait_for(routes_known, timeout=60, what="both endpoints at the router")
    # vLLM (the simulator's /openapi.json) serves /v1/responses; llama-server does not.
    ok = httpx.post(
        cluster.router_url + "/v1/responses", json={"model": "chat", "input": "hi"}, timeout=30
    )
    assert ok.status_code == 200, ok.text
    missing = httpx.post(
        cluster.router_url + "/v1/responses", json={"model": "tiny", "input": "hi"}, timeout=30
    )
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert error["code"] == "route_not_served"
    assert "/v1/responses" in error["message"]
    assert "tiny" in error["message"]
    # Anthropic's messages: llama-server serves them (its known routes).
    served = httpx.post(
        cluster.router_url + "/v1/messages",
        json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert served.status_code == 200, served.text
