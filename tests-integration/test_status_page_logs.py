"""The status page's engine log per shard (issue 29 point 2), in a real headless Chromium.

A control plane, one agent with a simulated vLLM that logs each request, and a router:
the page's `log` button on the replica's shard opens the panel with the engine's last
lines (GET /v1/logs/REPLICA?shard=N&tail=N&follow=1) and keeps following while open, so a
request sent afterwards shows its access line there; closing the panel ends the follow.
A screenshot goes to $LLMGW_SCREENSHOT_DIR (default /tmp/screens).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from llmgw_testkit.cluster import Cluster, vllm_profile

CHROMIUM = os.environ.get("LLMGW_CHROMIUM", "/usr/bin/chromium")
SCREENS = Path(os.environ.get("LLMGW_SCREENSHOT_DIR", "/tmp/screens"))
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync"]


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


def test_the_page_shows_and_follows_a_shards_engine_log(
    cluster: Cluster, page: Any, tmp_path: Path
) -> None:
    profile = vllm_profile(gpus=1, env={"LLMGW_SIM_LOG_REQUESTS": "1"})
    cluster.start_control([{"name": "chat", "profiles": {"default": profile}}])
    cluster.start_agent("gpu-a", gpus=1)
    cluster.start_router()
    (replica,) = cluster.wait_replicas("chat", 1)
    cluster.wait_router_models("chat")
    replica_id = replica["replica_id"]

    page.goto(f"http://127.0.0.1:{cluster.admin_port}/?refresh=0.5")
    button = f'#replicas tr[data-replica-id="{replica_id}"] button.log[data-shard="0"]'
    page.wait_for_selector(button, timeout=60_000)
    assert page.is_hidden("#log-panel")
    page.click(button)
    page.wait_for_selector("#log-panel:not([hidden])", timeout=10_000)
    assert replica_id in page.inner_text("#log-title")
    # Another tail length asks again.
    page.fill("#log-tail", "50")
    page.press("#log-tail", "Tab")
    page.wait_for_selector("#log-state.following", timeout=60_000)
    # The tail: what the engine printed while it started.
    page.wait_for_function(
        "() => document.getElementById('log-text').textContent.trim().length > 0",
        timeout=60_000,
    )

    # Followed while open: a request's access line appears without touching the page.
    deadline = time.monotonic() + 90
    access = '"POST /v1/chat/completions'
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with httpx.Client(base_url=cluster.router_url, timeout=60) as client:
        while access not in page.inner_text("#log-text"):
            assert time.monotonic() < deadline, page.inner_text("#log-text")[-2000:]
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            page.wait_for_timeout(200)  # let the page take its chunk between requests
    # The tables redraw every 0.5 s; the panel (outside them) stays open and following.
    assert page.get_attribute("#log-panel", "data-replica") == replica_id
    assert page.inner_text("#log-state") == "following"
    path = tmp_path / "llmgw-status-logs.png"
    page.screenshot(path=str(path), full_page=False)
    SCREENS.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, SCREENS / path.name)
    print(f"status page screenshot: {SCREENS / path.name}")

    page.click("#log-close")
    page.wait_for_selector("#log-panel", state="hidden", timeout=10_000)
