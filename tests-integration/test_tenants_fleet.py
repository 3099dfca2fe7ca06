"""Issue 27: keys the control plane manages, held across a fleet of two routers.

One control plane (mTLS, SQLite store), one agent with a simulated vLLM engine and two
routers (each its own router id), shared by the tests of this module in order: a
revocation refuses the key at both routers within 2 s; a budget raced by 50
concurrent requests through both routers ends at or under the budget; a key's rate
limit holds for the fleet (not per router) under uneven traffic; a control-plane
restart keeps the budget's usage and the budget still holds after it; the status page
shows the keys.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import pytest
from llmgw_testkit import Proc, free_port, wait_for
from llmgw_testkit.cluster import Cluster, bin_path, vllm_profile

MODELS = [{"name": "chat", "profiles": {"default": vllm_profile(gpus=1, replicas=1)}}]
SECRET = re.compile(r"llmgw_[0-9a-f]{8}_[A-Za-z0-9_-]{32,}")
# Prompt plus max_tokens: what a router reserves of a budget for each request.
CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@dataclass
class Router:
    name: str
    port: int
    admin_port: int
    proc: Proc

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/chat/completions"


def start_router(cluster: Cluster, name: str) -> Router:
    port, admin_port = free_port(), free_port()
    config = cluster.router_config(balancer="round_robin", tenants={"report_interval": "250ms"})
    config["listen"] = f"127.0.0.1:{port}"
    config["admin_listen"] = f"127.0.0.1:{admin_port}"
    config["control"]["router_id"] = name
    config["control"]["tls"] = cluster.router_cert(name)
    path = cluster.write(f"router-{name}.yaml", config)
    argv = [bin_path("llmgw-router"), "serve", "--config", str(path), "--log-format", "json"]
    proc = cluster._start(f"router-{name}", argv)
    wait_for(
        lambda: _healthy(admin_port) or not proc.alive(),
        timeout=30,
        what=f"router {name} /healthz",
    )
    assert proc.alive(), f"router {name} exited:\n{proc.tail()}"
    return Router(name, port, admin_port, proc)


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, list[Router]]]:
    cluster = Cluster(tmp_path_factory.mktemp("tenants"))
    try:
        cluster.start_control(MODELS)
        cluster.start_agent("gpu-a", gpus=1)
        cluster.wait_replicas("chat", 1, timeout=120)
        routers = [start_router(cluster, "ra"), start_router(cluster, "rb")]
        for r in routers:
            wait_for(partial(_serves, r), timeout=60, what=f"router {r.name} serving chat")
        yield cluster, routers
    finally:
        cluster.stop()


def _serves(r: Router) -> bool:
    try:
        models = httpx.get(f"http://127.0.0.1:{r.port}/v1/models", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return False
    return any(m.get("id") == "chat" for m in models.get("data", []))


def ctl(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_ADMIN")}
    env["LLMGW_ADMIN"] = f"127.0.0.1:{cluster.admin_port}"
    env["LLMGW_ADMIN_TOKEN_FILE"] = str(cluster.workdir / "control-state" / "admin.token")
    done = subprocess.run(
        [bin_path("llmgw-control"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done


def create_key(cluster: Cluster, name: str, *flags: str) -> str:
    out = ctl(cluster, "keys", "create", name, *flags).stdout.strip().splitlines()
    assert SECRET.fullmatch(out[-1]), out
    return out[-1]


def ask(r: Router, secret: str) -> int:
    try:
        return httpx.post(
            r.url, json=CHAT, headers={"Authorization": f"Bearer {secret}"}, timeout=60
        ).status_code
    except httpx.HTTPError:
        return 0


def until_answer(r: Router, secret: str, code: int, what: str, timeout: float = 30.0) -> None:
    def answered() -> bool:
        return ask(r, secret) == code

    wait_for(answered, timeout=timeout, interval=0.05, what=f"{what} at {r.name}")


def key_row(cluster: Cluster, name: str) -> dict[str, Any]:
    keys = cluster.admin("/v1/keys")["keys"]
    return next(k for k in keys if k["name"] == name)


def settled_usage(cluster: Cluster, name: str, requests: int) -> dict[str, Any]:
    """The key's row once both routers have reported ``requests`` requests."""
    return wait_for(
        lambda: row if (row := key_row(cluster, name))["usage"]["requests"] >= requests else None,
        timeout=30,
        what=f"{requests} requests of {name} reported",
    )


def test_revocation_refuses_the_key_at_both_routers_within_2s(
    fleet: tuple[Cluster, list[Router]],
) -> None:
    cluster, routers = fleet
    secret = create_key(cluster, "team-rev")
    for r in routers:
        until_answer(r, secret, 200, "the key")
    ctl(cluster, "keys", "revoke", "team-rev")
    # Both routers refuse it within 2 s of the revoke command's answer.
    deadline = time.monotonic() + 2.0
    for r in routers:
        until_answer(r, secret, 401, "the revoked key refused", deadline - time.monotonic())


BUDGET = 400
# Secrets of the keys made by earlier tests of this module.
SECRETS: dict[str, str] = {}


def race(routers: list[Router], secret: str, count: int) -> list[int]:
    with ThreadPoolExecutor(max_workers=count) as pool:
        return list(pool.map(lambda i: ask(routers[i % len(routers)], secret), range(count)))


def test_a_budget_raced_by_50_requests_ends_at_or_under_it(
    fleet: tuple[Cluster, list[Router]],
) -> None:
    cluster, routers = fleet
    secret = create_key(
        cluster, "team-budget", "--budget-tokens", str(BUDGET), "--budget-period", "day"
    )
    SECRETS["team-budget"] = secret
    # One request through each router: the key and a grant are there.
    for r in routers:
        until_answer(r, secret, 200, "a grant")
    codes = race(routers, secret, 50)
    served = 2 + codes.count(200)
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) > 0, "the budget refused nothing: it was never in reach"
    row = settled_usage(cluster, "team-budget", served)
    assert 0 < row["budget_used"] <= BUDGET
    # What the fleet used, as the routers counted it, stays within the budget too.
    assert row["usage"]["prompt_tokens"] + row["usage"]["completion_tokens"] <= BUDGET


def test_a_rate_limit_holds_for_the_fleet_under_uneven_traffic(
    fleet: tuple[Cluster, list[Router]],
) -> None:
    cluster, routers = fleet
    rpm = 40
    started = time.monotonic()
    secret = create_key(cluster, "team-rate", "--rpm", str(rpm))
    for r in routers:
        until_answer(r, secret, 200, "the key")
    heavy, light = routers
    admitted = {heavy.name: 1, light.name: 1}
    # Three requests at the heavy router for each one at the light router, 2.5x the limit.
    for i in range(100):
        r = light if i % 4 == 3 else heavy
        if ask(r, secret) == 200:
            admitted[r.name] += 1
    elapsed = time.monotonic() - started
    total = sum(admitted.values())
    # A limit per router would admit the limit (and its refill) at the heavy router and
    # all 25 at the light one, over 1.6x the limit. The fleet's admits the limit and what
    # refills while the test runs, with slack of two requests per router worker (four:
    # a worker's share is never under 1 request a minute at the router, and the shares'
    # first moves). Measured: 46-52 admitted of 40 over 9-18 s.
    assert total <= rpm * (1 + elapsed / 60) + 8, (admitted, elapsed)
    assert admitted[heavy.name] > admitted[light.name], admitted


def test_a_control_restart_keeps_the_budget_usage(
    fleet: tuple[Cluster, list[Router]],
) -> None:
    cluster, routers = fleet
    before = key_row(cluster, "team-budget")
    assert before["budget_used"] > 0
    assert cluster.control is not None
    cluster.control.stop()
    cluster.start_control(MODELS)
    after = wait_for(
        lambda: key_row(cluster, "team-budget"), timeout=30, what="the keys after a restart"
    )
    assert after["budget_used"] == before["budget_used"]
    assert after["usage"]["requests"] == before["usage"]["requests"]
    wait_for(
        # Router ids are per worker: "ra/w0", ...
        lambda: (
            {r.split("/")[0] for r in cluster.admin("/v1/status")["keys"]["routers"]}
            >= {"ra", "rb"}
        ),
        timeout=30,
        what="both routers reporting to the restarted control plane",
    )
    # The budget still holds through the routers after the restart.
    codes = race(routers, SECRETS["team-budget"], 20)
    assert set(codes) <= {200, 429}, codes
    row = settled_usage(cluster, "team-budget", before["usage"]["requests"] + codes.count(200))
    assert row["budget_used"] <= BUDGET


CHROMIUM = os.environ.get("LLMGW_CHROMIUM", "/usr/bin/chromium")


def test_the_status_page_shows_the_keys(fleet: tuple[Cluster, list[Router]]) -> None:
    cluster, _ = fleet
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"no Chromium at {CHROMIUM}: apt-get install -y chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        try:
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{cluster.admin_port}/")
            row = page.locator('#keys tr[data-key="team-budget"]')
            row.wait_for(timeout=30_000)
            text = row.inner_text()
            assert re.search(rf"\b\d+ of {BUDGET} / day\b", text), text
            revoked = page.locator('#keys tr[data-key="team-rev (revoked)"]')
            revoked.wait_for(timeout=30_000)
        finally:
            browser.close()
