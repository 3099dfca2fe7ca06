"""A router given endpoints it cannot parse serves from the healthy one: no 500 (issue 24.7).

A real router process watching a scripted control plane over real gRPC, and a real
upstream process. The control plane of this version never publishes such a URL (it
fails the shard); an older or foreign one might, and a router must not answer 500 for it.
The healthy endpoint is a simulated vLLM engine (llmgw-sim).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from llmgw_testkit import free_port, wait_for

Router = Any
Engine = Any
Control = Any
Spawn = Callable[..., Any]

BAD = ["http://127.0.0.1:99999", "http://:8000"]
# The engine, as vLLM does, refuses a chat without messages.
HELLO = [{"role": "user", "content": "hello"}]


def publish(control: Control, version: int, endpoints: list[tuple[str, str]]) -> None:
    body = {
        "version": version,
        "endpoints": [{"id": i, "url": u, "models": ["m1"]} for i, u in endpoints],
        "models": [],
    }
    tmp = control.snapshot_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body))
    tmp.replace(control.snapshot_path)


def applied(log: str, version: int) -> bool:
    """The router's JSON log says the snapshot of ``version`` was applied."""
    for line in log.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "endpoint snapshot applied" and event.get("version") == version:
            return True
    return False


def test_unparseable_endpoints_are_ignored_and_every_request_is_served(
    spawn_router: Spawn, spawn_engines: Callable[..., list[Engine]], control: Control
) -> None:
    (e1,) = spawn_engines(1)
    router = spawn_router(
        {
            "control": {
                "address": control.address,
                "tls": {"insecure": True},
                "backoff_base": "100ms",
                "backoff_cap": "500ms",
            },
            # Spread by outstanding count: a bad endpoint, were it kept, would be picked.
            "balancer": "least_outstanding",
            "health_checks": {"interval": "200ms"},
        },
        wait_ready=False,
    )
    with router.proc:
        published = [(f"bad{i}", url) for i, url in enumerate(BAD)] + [("e1-replica", e1.url)]
        publish(control, 1, published)
        wait_for(
            lambda: [ep["id"] for ep in router.endpoints()["endpoints"]] == ["e1-replica"],
            timeout=30,
            what="the snapshot applied, the bad endpoints left out",
        )
        url = router.url + "/v1/chat/completions"
        statuses = [
            httpx.post(url, json={"model": "m1", "messages": HELLO}, timeout=30).status_code
            for _ in range(12)
        ]
        assert statuses == [200] * 12
        # A new snapshot with the same bad URLs: still ignored, not logged again.
        publish(control, 2, published)
        control.proc.wait_output("published version=2")
        wait_for(
            lambda: applied(router.proc.output(), 2),
            timeout=30,
            what="the second snapshot applied",
        )
        assert [ep["id"] for ep in router.endpoints()["endpoints"]] == ["e1-replica"]
        log = router.proc.output()
        for bad in BAD:
            assert log.count(f"endpoint URL {bad!r}") == 1, log[-3000:]
        assert "Traceback" not in log


@pytest.mark.parametrize("bad", BAD)
def test_a_static_endpoint_that_cannot_be_parsed_is_refused_at_start(
    tmp_path: Path, bad: str
) -> None:
    """In the router's own config file the operator gets a clear error, not a 500 later."""
    import subprocess
    import sys

    config = tmp_path / "router.yaml"
    config.write_text(
        yaml.safe_dump(
            {"listen": f"127.0.0.1:{free_port()}", "admin_listen": f"127.0.0.1:{free_port()}",
             "endpoints": [{"id": "e", "url": "http://127.0.0.1:8000", "models": ["m"]},
                           {"id": "x", "url": bad, "models": ["m"]}]}
        )
    )  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "llmgw_router", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert f"{config}: $.endpoints[1].url: endpoint URL {bad!r}" in done.stderr
    assert "Traceback" not in done.stderr
