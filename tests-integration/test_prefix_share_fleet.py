"""Issue 26: routers share the prefixes they see through the control plane
(`SharePrefixes`), so each computes cache_aware's shared homes from the fleet's set.

Real control plane (mTLS), one agent with two simulated vLLM engines (each a tight
cache) and two router processes (each its own router id, `cache_aware.shared_homes`).
Router ra is sent only tenant A's prompts and router rb only tenant B's: rb learns A's
prefix (and ra B's) from the control plane, which neither router has seen itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from llmgw_testkit import Proc, free_port, wait_for
from llmgw_testkit.cluster import Cluster, bin_path, vllm_profile

MODELS = [
    {
        "name": "chat",
        "profiles": {
            "default": vllm_profile(gpus=1, replicas=2, args=["--num-gpu-blocks-override", "1088"])
        },
    }
]


@dataclass
class Router:
    name: str
    port: int
    admin_port: int
    proc: Proc

    def admin(self) -> dict[str, Any]:
        url = f"http://127.0.0.1:{self.admin_port}/v1/endpoints"
        view: dict[str, Any] = httpx.get(url, timeout=5).json()
        return view

    def ask(self, tenant: str, turn: int) -> None:
        system = f"You answer for tenant {tenant}. " + "Policy text. " * 120
        body = {
            "model": "chat",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"question {turn}"},
            ],
            "max_tokens": 2,
        }
        url = f"http://127.0.0.1:{self.port}/v1/chat/completions"
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 200, r.text


def start_router(cluster: Cluster, name: str) -> Router:
    port, admin_port = free_port(), free_port()
    # One worker: the admin view is that worker's balancer (each worker of a router
    # shares its own prefixes, under its own router id).
    config = cluster.router_config(cache_aware={"shared_homes": True}, workers=1)
    config["listen"] = f"127.0.0.1:{port}"
    config["admin_listen"] = f"127.0.0.1:{admin_port}"
    config["control"]["router_id"] = name
    config["control"]["tls"] = cluster.router_cert(name)
    path = cluster.write(f"router-{name}.yaml", config)
    argv = [bin_path("llmgw-router"), "serve", "--config", str(path), "--log-format", "json"]
    proc = cluster._start(f"router-{name}", argv)
    router = Router(name, port, admin_port, proc)
    wait_for(
        lambda: _endpoints(router) >= 2 or not proc.alive(),
        timeout=90,
        what=f"router {name} with both engines ready",
    )
    assert proc.alive(), f"router {name} exited:\n{proc.tail()}"
    return router


def _endpoints(router: Router) -> int:
    """Endpoints the router may pick now (a prompt goes through the balancer's prefix
    rules only where there are two)."""
    try:
        return sum(1 for ep in router.admin()["endpoints"] if ep["state"] == "ready")
    except (httpx.HTTPError, ValueError, KeyError):
        return 0


@pytest.fixture
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Router]]:
    cluster = Cluster(tmp_path_factory.mktemp("prefixes"))
    try:
        cluster.start_control(MODELS)
        cluster.start_agent("gpu-a", gpus=2)
        cluster.wait_replicas("chat", 2, timeout=120)
        yield [start_router(cluster, "ra"), start_router(cluster, "rb")]
    finally:
        cluster.stop()


def test_each_router_learns_the_prefixes_only_the_other_saw(fleet: list[Router]) -> None:
    ra, rb = fleet
    for turn in (1, 2):
        ra.ask("A", turn)
        rb.ask("B", turn)
    own_a = set(ra.admin()["prefix_keys"]["own_keys"])
    own_b = set(rb.admin()["prefix_keys"]["own_keys"])
    assert len(own_a) == 1
    assert len(own_b) == 1
    assert own_a != own_b

    def learned(router: Router) -> dict[str, Any] | None:
        keys = router.admin()["prefix_keys"]
        return keys if set(keys["fleet_keys"]) == own_a | own_b else None

    # Within a few of the routers' 1 s reports: each has the other's prefix and its own
    # (the union the control plane answers is computed again at most every 0.25 s: a
    # reply may not hold the report it answers yet).
    at_b = wait_for(lambda: learned(rb), timeout=30, what="rb has ra's prefix and its own")
    at_a = wait_for(lambda: learned(ra), timeout=30, what="ra has rb's prefix and its own")
    assert at_b["fleet"] == 2
    # What each router saw itself is unchanged: the other's prefix came from the fleet.
    assert set(at_b["own_keys"]) == own_b
    assert set(at_a["own_keys"]) == own_a
