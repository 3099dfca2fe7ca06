"""deploy/grafana/llmgw.json's layout (issue 29 point 5): a row of stat panels at the
top, and the engine panels on the routers' per-endpoint series, so no scrape list of
the engines' dynamic ports is needed. That every queried metric is exported is
test_dashboard's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "llmgw.json"


def panels() -> list[dict[str, Any]]:
    return list(json.loads(DASHBOARD.read_text())["panels"])


def test_a_stat_row_comes_first() -> None:
    ps = panels()
    assert ps[0]["type"] == "row"
    assert ps[0]["gridPos"]["y"] == 0
    top = [p for p in ps if p["gridPos"]["y"] == 1]
    assert top, "nothing right under the first row"
    assert {p["type"] for p in top} == {"stat"}
    titles = {p["title"] for p in top}
    assert {"Requests/s", "Errors (5xx)", "TTFT p90", "Nodes not answering"} <= titles
    assert sum(p["gridPos"]["w"] for p in top) == 24
    # Nothing overlaps: every other panel starts below the stat row.
    assert all(p["gridPos"]["y"] >= 5 for p in ps[1 + len(top) :])


def test_engine_panels_read_the_routers_per_endpoint_series() -> None:
    exprs = [t["expr"] for p in panels() for t in p.get("targets", [])]
    assert not [e for e in exprs if "vllm:" in e or "sglang:" in e], "an engine's own series"
    for name in (
        "llmgw_router_engine_running",
        "llmgw_router_engine_waiting",
        "llmgw_router_engine_kv_cache_usage",
    ):
        assert any(name in e for e in exprs), name


def test_panel_ids_are_unique() -> None:
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids))
