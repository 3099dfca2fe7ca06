"""The status page at a glance (issue 29 point 4), in a real headless Chromium.

One fleet (control plane, one agent with a simulated engine) and one page, never
reloaded: the models row shows ready/wanted and KV use with sparklines that grow as
the control plane samples its history; nodes show each GPU's memory and use; with
the admin token the rows get their actions, and a cordon from the page reaches the
control plane; when the agent is frozen the attention banner names the node.
Screenshots go to $LLMGW_SCREENSHOT_DIR (default /tmp/screens).
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from llmgw_testkit.cluster import Cluster, vllm_profile

CHROMIUM = os.environ.get("LLMGW_CHROMIUM", "/usr/bin/chromium")
SCREENS = Path(os.environ.get("LLMGW_SCREENSHOT_DIR", "/tmp/screens"))
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Any]:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"no Chromium at {CHROMIUM}: apt-get install -y chromium (or LLMGW_CHROMIUM)")
    from playwright.sync_api import sync_playwright

    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile),
            executable_path=CHROMIUM,
            headless=True,
            args=ARGS,
            viewport={"width": 1500, "height": 1000},
        )
        try:
            yield context.pages[0] if context.pages else context.new_page()
        finally:
            context.close()


def shot(page: Any, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    page.screenshot(path=str(path), full_page=True)
    SCREENS.mkdir(parents=True, exist_ok=True)
    kept = SCREENS / name
    shutil.copyfile(path, kept)
    print(f"status page screenshot: {kept}")
    return kept


def points(page: Any, cell: str) -> int:
    found = page.get_attribute(f'#models tr[data-model="chat"] {cell} svg', "data-points")
    return int(found or 0)


def test_status_page_at_a_glance(cluster: Cluster, page: Any, tmp_path: Path) -> None:
    cluster.start_control([{"name": "chat", "profiles": {"default": vllm_profile(gpus=1)}}])
    agent = cluster.start_agent("gpu-a", gpus=2)
    cluster.start_router()
    cluster.wait_replicas("chat", 1)
    cluster.wait_router_models("chat")
    page.goto(f"http://127.0.0.1:{cluster.admin_port}/?refresh=0.5")
    page.wait_for_selector("#conn.ok", timeout=30_000)
    page.evaluate("window.__firstLoad = 'yes'")

    # The models row: ready/wanted, and nothing needs attention.
    row = page.wait_for_selector('#models tr[data-model="chat"][data-short="no"]', timeout=60_000)
    assert "1 / 1" in row.inner_text()
    page.wait_for_selector("#allwell:not([hidden])", timeout=30_000)
    assert page.is_hidden("#attention")
    # Human units: no raw publish version; times and ages in words.
    meta = page.inner_text("#meta")
    assert "publish version" not in meta
    assert "up since" in meta

    # GPUs: memory used of total and utilization, per GPU.
    gpu = page.inner_text('#nodes tr[data-node-id="gpu-a"] td.gpu-use')
    assert "GB" in gpu or "GiB" in gpu, gpu
    assert "% busy" in gpu, gpu

    # Traffic through the router until the row shows the routers' figures (reported
    # every 5 s, sampled every 10 s): requests/s, error rate, TTFT.
    rps = page.locator('#models tr[data-model="chat"] td.rps')
    deadline = time.monotonic() + 90
    with httpx.Client(base_url=cluster.router_url, timeout=60) as client:
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
        while rps.inner_text() == "—":
            assert time.monotonic() < deadline, "the routers' figures never reached the page"
            assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert float(rps.inner_text()) > 0
    assert page.inner_text('#models tr[data-model="chat"] td.errors') == "0.0%"
    assert "ms" in page.inner_text('#models tr[data-model="chat"] td.ttft')
    # The history keeps them (the row shows only the last sample's).
    series = cluster.status()["history"]["models"]["chat"]
    sampled = [
        (p50, p90) for p50, p90 in zip(series["ttft_p50"], series["ttft_p90"], strict=True) if p50
    ]
    assert sampled, series
    assert all(p90 >= p50 > 0 for p50, p90 in sampled), sampled
    assert max(x or 0 for x in series["requests_per_s"]) > 0, series
    page.wait_for_function(
        """() => Number(document.querySelector('#models tr[data-model="chat"] .spark-kv svg')
              ?.getAttribute("data-points") || 0) >= 2""",
        timeout=60_000,
    )
    before = points(page, ".spark-load")
    page.wait_for_function(
        """n => Number(document.querySelector('#models tr[data-model="chat"] .spark-load svg')
              ?.getAttribute("data-points") || 0) > n""",
        arg=before,
        timeout=60_000,
    )
    assert page.locator('#models tr[data-model="chat"] .spark-load polyline').count() == 1
    shot(page, tmp_path, "llmgw-status-glance.png")

    # Actions need the admin token; with it, a cordon from the page reaches the control plane.
    assert page.locator("#nodes button.act").count() == 0
    token = (cluster.workdir / "control-state" / "admin.token").read_text().strip()
    page.click("#actions-box summary")
    page.fill("#token", token)
    page.dispatch_event("#token", "change")
    page.wait_for_selector('#nodes tr[data-node-id="gpu-a"] button[data-action="cordon"]')
    page.once("dialog", lambda dialog: dialog.accept())
    page.click('#nodes tr[data-node-id="gpu-a"] button[data-action="cordon"]')
    page.wait_for_selector("#act-result:has-text('✓')", timeout=30_000)
    ops = cluster.admin("/v1/ops")
    assert [n["node_id"] for n in ops["nodes"] if n.get("cordoned")] == ["gpu-a"], ops

    # The agent frozen: the banner says the node does not answer, without a reload.
    agent.signal(signal.SIGSTOP)
    try:
        page.wait_for_selector(
            '#attention:not([hidden]) li[data-kind="node"][data-subject="gpu-a"]', timeout=60_000
        )
        assert "node gpu-a is unreachable" in page.inner_text("#attention")
        shard = page.inner_text('#replicas tr[data-state="unreachable"] .shards')
        assert "unreachable" in shard, shard
        shot(page, tmp_path, "llmgw-status-attention.png")
    finally:
        agent.signal(signal.SIGCONT)
    assert page.evaluate("window.__firstLoad") == "yes"
