"""The control plane's web status page, in a real headless Chromium.

The page is opened once, before any agent has registered, and never reloaded: it must
show the replica becoming READY and, after its agent is frozen with SIGSTOP, the node
going UNREACHABLE, all by polling the JSON status API itself. A screenshot is kept.

Chromium is Debian's (`apt-get install -y chromium`, as .ci/run does), driven by
Playwright's Python package; Playwright's own browser download is never used.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llmgw_testkit.cluster import Cluster, vllm_profile

CHROMIUM = os.environ.get("LLMGW_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    # Without these Chromium reaches out to hosts this machine cannot reach.
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]
# Every state each row of the replicas table has shown, by replica id, recorded in the page.
RECORD_STATES = """
window.__llmgwSeen = {};
new MutationObserver(() => {
  for (const row of document.querySelectorAll("#replicas tr[data-replica-id]")) {
    const seen = (window.__llmgwSeen[row.getAttribute("data-replica-id")] ??= []);
    const s = row.getAttribute("data-state");
    if (seen[seen.length - 1] !== s) seen.push(s);
  }
}).observe(document, {subtree: true, childList: true, attributes: true});
"""


@pytest.fixture
def browser_page(tmp_path: Path) -> Iterator[Any]:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(
            f"no Chromium at {CHROMIUM}: apt-get install -y chromium (or set LLMGW_CHROMIUM)"
        )
    from playwright.sync_api import sync_playwright

    profile = tmp_path / "chromium-profile"  # an empty --user-data-dir
    profile.mkdir()
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 900},
        )
        try:
            page = context.pages[0] if context.pages else context.new_page()
            page.add_init_script(RECORD_STATES)
            yield page
        finally:
            context.close()


def keep_screenshot(
    page: Any, tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> Path:
    shot = tmp_path / name
    page.screenshot(path=str(shot), full_page=True)
    out_dir = Path(os.environ.get("LLMGW_SCREENSHOT_DIR", tempfile.gettempdir()))
    out_dir.mkdir(parents=True, exist_ok=True)
    kept = out_dir / name
    shutil.copyfile(shot, kept)
    with capsys.disabled():
        print(f"\nstatus page screenshot: {kept}")
    return kept


def test_status_page_follows_the_cluster_without_a_reload(
    cluster: Cluster, browser_page: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = browser_page

    def models(*args: str) -> list[dict[str, Any]]:
        # chat loads for a few seconds, so the page sees it starting before it is ready;
        # huge wants more GPUs than any node has: the page explains why it is not placed.
        slow = {"LLMGW_SIM_LOAD_TIME": "4"}
        return [
            {"name": "chat", "profiles": {"default": vllm_profile(gpus=2, env=slow, args=args)}},
            {"name": "huge", "profiles": {"default": vllm_profile(gpus=8)}},
        ]

    cluster.start_control(models())
    page.goto(f"http://127.0.0.1:{cluster.admin_port}/?refresh=0.5")
    page.wait_for_selector("#conn.ok", timeout=30_000)
    assert "no agent has registered yet" in page.inner_text("#nodes")
    page.evaluate("window.__llmgwNoReload = 'still the first load'")

    cluster.start_agent("gpu-a", gpus=4, labels={"fabric.nvlink-domain": "nv-a"})
    cluster.start_agent("gpu-b", gpus=4, labels={"fabric.nvlink-domain": "nv-b"})

    ready = page.wait_for_selector('#replicas tr[data-state="ready"]', timeout=90_000)
    replica_id = ready.get_attribute("data-replica-id")
    (replica,) = [r for r in cluster.replicas("chat") if r["replica_id"] == replica_id]
    (node_id,) = replica["nodes"]
    row_text = ready.inner_text()
    assert replica["endpoint"] in row_text
    assert "chat / default" in row_text
    seen = page.evaluate("id => window.__llmgwSeen[id]", replica_id)
    assert seen[-1] == "ready", seen
    assert len(seen) > 1, f"the page never showed the replica before it was ready: {seen}"

    node_row = page.locator(f'#nodes tr[data-node-id="{node_id}"]')
    page.wait_for_function(
        'id => document.querySelector(`#nodes tr[data-node-id="${id}"] .gpus`)'
        "?.textContent === '2/4'",
        arg=node_id,
        timeout=30_000,
    )
    assert "fabric.nvlink-domain=nv-" in node_row.inner_text()
    # The engines the agent found, with their versions (the simulator's vLLM here).
    assert re.search(r"vllm \d", node_row.locator("td").nth(5).inner_text())
    # The engine's live load, as agents report it and routers get it.
    page.wait_for_selector(f'#load tr[data-key="{replica_id}"]', timeout=30_000)
    # The replica nobody can place says why, in the placer's own words.
    # (Once both nodes have registered: the page catches up by itself.)
    page.wait_for_selector('#unplaceable td.explain:has-text("of 2 nodes fit")', timeout=30_000)
    assert "huge / default" in page.locator("#unplaceable").inner_text()

    # A changed profile rolls: the page shows the rollout while the new replica starts.
    cluster.write("control.yaml", cluster.control_config(models("--max-model-len", "4096")))
    assert cluster.control is not None
    cluster.control.signal(signal.SIGHUP)
    rollout = page.wait_for_selector('#rollouts tr[data-key="chat"]', timeout=60_000)
    assert "default" in rollout.inner_text()
    keep_screenshot(page, tmp_path, "llmgw-status-page-rollout.png", capsys)
    page.wait_for_selector(
        f'#replicas tr[data-state="ready"]:not([data-replica-id="{replica_id}"])', timeout=90_000
    )

    agent = cluster.agents[node_id]
    agent.signal(signal.SIGSTOP)  # frozen: stream open, heartbeats stop
    try:
        page.wait_for_selector(
            f'#nodes tr[data-node-id="{node_id}"][data-state="UNREACHABLE"]', timeout=60_000
        )
        assert "UNREACHABLE" in node_row.inner_text()
        keep_screenshot(page, tmp_path, "llmgw-status-page.png", capsys)
    finally:
        agent.signal(signal.SIGCONT)
    assert page.evaluate("window.__llmgwNoReload") == "still the first load"
