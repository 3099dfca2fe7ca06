"""Every metric the Grafana dashboard (deploy/grafana/llmgw.json) queries is exported.

The programs run for real (control plane, agent, router, simulated vLLM and SGLang
engines), serve a few requests, and their /metrics pages are read; each metric name
found in the dashboard's PromQL must be among what they export.
"""

from __future__ import annotations

import contextlib
import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import pytest
from llmgw_testkit import wait_for
from llmgw_testkit.cluster import Cluster, vllm_profile

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "llmgw.json"

_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
    "and", "or", "unless", "inf", "nan",
}  # fmt: skip
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not functions, labels or keywords)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = _GROUPING.sub(" ", text)  # label lists of by (...) and friends
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # Grafana variables
    names = set()
    for match in _IDENT.finditer(text):
        word = match.group()
        following = text[match.end() :].lstrip()
        if following.startswith("(") or word.lower() in _KEYWORDS:
            continue  # a function or aggregation, or a keyword
        if text[: match.start()].rstrip().endswith(tuple("0123456789.")):
            continue  # a unit suffix like the "m" of 5m, or an exponent
        names.add(word)
    return names


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    found: list[tuple[str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    found.append((f"panel {panel['title']!r}", target["expr"]))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            inner = re.fullmatch(r"\s*label_values\((.*?)(?:,\s*\w+)?\)\s*", query)
            found.append((f"variable ${var['name']}", inner.group(1) if inner else query))
    return found


def exported(metrics_text: str) -> set[str]:
    """Every series name a /metrics page can answer for: samples and declared families."""
    names: set[str] = set()
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ", 3)
            names.add(family)
            suffixes = {
                "counter": ["_total"],
                "histogram": ["_bucket", "_sum", "_count"],
                "summary": ["_sum", "_count"],
            }.get(kind.strip(), [])
            names.update(family.removesuffix("_total") + s for s in suffixes)
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            'histogram_quantile(0.99, sum by (le, model) (rate(a_b_bucket{model=~"$model"}'
            "[$__rate_interval])))",
            {"a_b_bucket"},
        ),
        (
            'sum by (model) (rate(x_total{status=~"5.."}[5m])) / sum(rate(y_total[1h]))',
            {"x_total", "y_total"},
        ),
        ("max by (instance) (vllm:kv_cache_usage_perc) offset 5m", {"vllm:kv_cache_usage_perc"}),
        ("up == bool 1 and on (job) z unless ignoring(a, b) w", {"up", "z", "w"}),
        ("1e3 * rate(q[1m:10s])", {"q"}),
    ],
)
def test_metric_names_parses_promql(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def test_every_metric_the_dashboard_queries_is_exported(cluster: Cluster) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 20, "the dashboard lost its panels"
    wanted = {name: where for where, expr in queries for name in metric_names(expr)}
    assert wanted, "no metric names found in the dashboard's queries"

    cluster.start_control(
        [
            {"name": "chat", "profiles": {"default": vllm_profile(gpus=1)}},
            {"name": "chat-sg", "profiles": {"default": vllm_profile(gpus=1, engine="sglang")}},
            # Every request fails: retries, a spent retry budget, upstream errors, ejections.
            {
                "name": "flaky",
                "profiles": {
                    "default": vllm_profile(gpus=1, replicas=2, env={"LLMGW_SIM_ERROR_RATE": "1"})
                },
            },
        ]
    )
    cluster.start_agent("gpu-a", gpus=4)
    # One retry token and no refill: the first retry is made, the later ones denied.
    cluster.start_router(retries={"budget_ratio": 0, "budget_min_per_second": 0}, workers=1)
    (vllm,) = cluster.wait_replicas("chat", 1)
    (sglang,) = cluster.wait_replicas("chat-sg", 1)
    cluster.wait_replicas("flaky", 2)
    cluster.wait_router_models("chat", "chat-sg", "flaky")

    # Traffic, so every labelled series has samples: the programs export a family once it
    # has one (the router's worker supervisor sums only what its workers report).
    with httpx.Client(base_url=cluster.router_url, timeout=30) as client:
        for model in ("chat", "chat-sg"):
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            with client.stream(
                "POST", "/v1/chat/completions", json={**body, "stream": True, "max_tokens": 8}
            ) as resp:
                assert resp.status_code == 200
                resp.read()
        assert client.post("/v1/chat/completions", json={"model": "nope"}).status_code >= 400
        flaky = {"model": "flaky", "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(8):
            assert client.post("/v1/chat/completions", json=flaky).status_code >= 500
        # A client that leaves in the middle of a stream.
        long = {"model": "chat", "stream": True, "max_tokens": 2000, "messages": flaky["messages"]}
        with client.stream("POST", "/v1/chat/completions", json=long) as resp:
            assert resp.status_code == 200
            next(resp.iter_lines())

    def missing() -> dict[str, str]:
        pages = {
            "control plane": cluster.metrics(),
            "router": get(f"http://127.0.0.1:{cluster.router_admin_port}/metrics"),
            "vLLM engine": get(f"{vllm['endpoint']}/metrics"),
            "SGLang engine": get(f"{sglang['endpoint']}/metrics"),
        }
        have = set().union(*(exported(text) for text in pages.values()))
        assert "llmgw_router_no_such_metric_total" not in have
        return {name: where for name, where in wanted.items() if name not in have}

    # The router counts a disconnect when it notices it: wait for that, with a deadline.
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: not missing(), timeout=30, interval=0.5, what="every metric")
    gone = missing()
    assert not gone, "the dashboard queries metrics nothing exports: " + ", ".join(
        f"{name} ({where})" for name, where in sorted(gone.items())
    )
