"""Metrics hygiene and one error shape (issue 29 point 10), on real processes.

A control plane, an agent with simulated vLLM and SGLang engines and a router run for
real. Their /metrics pages pass `promtool check metrics` and export every metric the
alert rules in deploy/prometheus read; the router's error counters are there at 0 before
any error; a 503 for a model without an endpoint is counted under that model; engine
errors reach the client in OpenAI's shape like the router's own; every answer carries
an `x-request-id` (the client's, or one the router made); and a stream cut by a dying
engine is counted as a 502, not as the 200 its head said.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import pytest
from llmgw_testkit import wait_for
from llmgw_testkit.cluster import Cluster, metric_sum, vllm_profile

RULES = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "llmgw-alerts.yml"
CHAT = [{"role": "user", "content": "hi"}]


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def promtool_errors(text: str) -> str:
    """What `promtool check metrics` says is wrong with a page ("" when nothing)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is missing: apt-get install prometheus (noxfile.py installs it)")
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    said = checked.stdout + checked.stderr
    # Lint advice (a counter's unit, say) is not an error; a page it cannot parse is.
    return said if checked.returncode != 0 and "error" in said.lower() else ""


def exported(text: str) -> set[str]:
    return {re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines() if line[:1] != "#"}


def openai_shaped(resp: httpx.Response) -> dict[str, Any]:
    data = resp.json()
    assert list(data) == ["error"], data
    error = data["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str), error
    assert error["message"], error
    assert re.fullmatch(r"[a-z_]+", error["type"]), error
    assert error["code"] is None or isinstance(error["code"], str), error
    return dict(error)


def test_metrics_error_shape_and_request_ids(cluster: Cluster) -> None:
    cluster.start_control(
        [
            {"name": "chat", "profiles": {"default": vllm_profile(gpus=1)}},
            {"name": "chat-sg", "profiles": {"default": vllm_profile(gpus=1, engine="sglang")}},
            # Every request fails with a 500 from the engine (vLLM's own error body).
            {
                "name": "flaky",
                "profiles": {"default": vllm_profile(gpus=1, env={"LLMGW_SIM_ERROR_RATE": "1"})},
            },
            # Slow tokens: a stream long enough to cut by killing its engine.
            {
                "name": "slow",
                "profiles": {"default": vllm_profile(gpus=1, env={"LLMGW_SIM_ITL": "0.05"})},
            },
            # Scale to zero: declared, no endpoint until demand.
            {"name": "later", "profiles": {"default": vllm_profile(replicas={"min": 0, "max": 1})}},
        ]
    )
    cluster.start_agent("gpu-a", gpus=8)
    # Not held: a request for `later` is answered 503 at once.
    cluster.start_router(hold={"enabled": False})
    for model in ("chat", "chat-sg", "flaky", "slow"):
        cluster.wait_replicas(model, 1)
    cluster.wait_router_models("chat", "chat-sg", "flaky", "slow")
    router_metrics = f"http://127.0.0.1:{cluster.router_admin_port}/metrics"

    # Before any error: the error counters are there, at 0, for every model and endpoint.
    def zeroed() -> str | None:
        page = get(router_metrics)
        wanted = [
            'llmgw_router_retries_total{model="chat"} 0.0',
            'llmgw_router_client_disconnects_total{model="chat"} 0.0',
            'llmgw_router_retries_denied_total{model="flaky"} 0.0',
        ]
        return page if all(w in page for w in wanted) else None

    page = wait_for(zeroed, timeout=30, what="error counters at 0 on the router's /metrics")
    assert re.search(r'llmgw_router_ejections_total\{endpoint="[^"]+"\} 0\.0', page), page
    assert re.search(
        r'llmgw_router_upstream_errors_total\{endpoint="[^"]+",reason="connect"\} 0\.0', page
    ), page

    with httpx.Client(base_url=cluster.router_url, timeout=60) as client:
        # x-request-id: made by the router, or the client's passed through, on every answer.
        ok = client.post("/v1/chat/completions", json={"model": "chat", "messages": CHAT})
        assert ok.status_code == 200
        assert re.fullmatch(r"[0-9a-f]{32}", ok.headers["x-request-id"]), ok.headers
        mine = client.post(
            "/v1/chat/completions",
            json={"model": "chat", "messages": CHAT},
            headers={"x-request-id": "client-chosen-1"},
        )
        assert mine.headers["x-request-id"] == "client-chosen-1"
        unknown = client.post("/v1/chat/completions", json={"model": "nope", "messages": CHAT})
        assert unknown.status_code == 404
        assert unknown.headers.get("x-request-id")
        assert client.get("/v1/models").headers.get("x-request-id")

        # The engines' errors in OpenAI's shape: SGLang's flat 400, vLLM's 500.
        bad = client.post(
            "/v1/chat/completions", json={"model": "chat-sg", "messages": CHAT, "n": "two"}
        )
        assert 400 <= bad.status_code < 500, bad.text
        assert openai_shaped(bad)["type"] == "invalid_request_error"
        assert bad.headers.get("x-request-id")
        failed = client.post("/v1/chat/completions", json={"model": "flaky", "messages": CHAT})
        assert failed.status_code >= 500, failed.text
        openai_shaped(failed)

        # A model the router knows, with no endpoint: 503, counted under its name.
        later = client.post("/v1/chat/completions", json={"model": "later", "messages": CHAT})
        assert later.status_code == 503, later.text
        assert openai_shaped(later)["code"] == "no_usable_endpoint"

        # A stream cut by its dying engine.
        (slow,) = cluster.replicas("slow")
        body = {"model": "slow", "messages": CHAT, "stream": True, "max_tokens": 4000}
        with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            for pid in (shard["pid"] for shard in slow["shards"]):
                os.kill(pid, signal.SIGKILL)
            rest = list(lines)
        assert any('"upstream_error"' in line for line in rest), rest[-5:]

    def counted() -> str | None:
        page = get(router_metrics)
        return page if metric_sum(page, "llmgw_router_requests_total", model="slow") else None

    page = wait_for(counted, timeout=30, what="the cut stream counted")
    assert metric_sum(page, "llmgw_router_requests_total", model="slow", status="502") == 1, page
    assert metric_sum(page, "llmgw_router_requests_total", model="slow", status="200") == 0
    assert metric_sum(page, "llmgw_router_requests_total", model="later", status="503") == 1
    assert metric_sum(page, "llmgw_router_requests_total", model="", status="503") == 0

    # Both pages are valid exposition, and together export what the alert rules read.
    control_page = cluster.metrics()
    assert promtool_errors(control_page) == ""
    assert promtool_errors(page) == ""
    have = exported(control_page) | exported(page)
    read = set(re.findall(r"\bllmgw_[a-z_]+", RULES.read_text()))
    assert not read - have, f"alert rules read metrics nothing exports: {read - have}"
