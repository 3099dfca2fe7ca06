"""Routing that sees the engines, with real processes: a scripted control plane streams
snapshots and load figures (WatchLoad) to real routers over real gRPC.

Issue 15 (two routers agree on a prefix's endpoint, load figures steer and show, a
stale report and a lost control plane fall back to the router's own counts), 14.2 (a
standby's `llmgw-leader` answer is followed) and 17.3 (requests held for a model scaled
to zero, demand reported, all served when the first endpoint appears; 503 past the
timeout).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from llmgw_testkit import free_port, wait_for

Router = Any
Upstream = Any
Spawn = Callable[..., Any]


def config(control: Any, **extra: Any) -> dict[str, Any]:
    return {
        "control": {
            "address": control.address,
            "tls": {"insecure": True},
            "backoff_base": "100ms",
            "backoff_cap": "300ms",
        },
        "health_checks": {"enabled": False},
        **extra,
    }


def prompt(tenant: int) -> dict[str, Any]:
    system = f"You answer for tenant {tenant}. " + "Policy text. " * 150
    return {
        "model": "m1",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"question {tenant}"},
        ],
    }


def served_by(router: Router, body: dict[str, Any]) -> str:
    r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return str(r.headers["x-sim-name"])


def endpoint(router: Router, ident: str) -> dict[str, Any]:
    return next(ep for ep in router.endpoints()["endpoints"] if ep["id"] == ident)


def test_two_routers_pick_the_same_endpoint_for_the_same_prefix(
    spawn_router: Spawn, upstreams: list[Upstream], control: Any
) -> None:
    e1, e2 = upstreams
    control.publish(1, e1, e2)
    a, b = spawn_router(config(control)), spawn_router(config(control))
    assert a.endpoints()["balancer"] == "cache_aware"
    owners = {}
    for tenant in range(12):
        owner = served_by(a, prompt(tenant))
        # The other router, which never talked to the first, agrees.
        assert served_by(b, prompt(tenant)) == owner
        # And the prefix stays where it went.
        assert served_by(a, prompt(tenant)) == owner
        owners[tenant] = owner
    # Different prefixes spread over both endpoints.
    assert set(owners.values()) == {"e1", "e2"}


def test_engine_load_steers_shows_and_goes_stale(
    spawn_router: Spawn, upstreams: list[Upstream], control: Any
) -> None:
    e1, e2 = upstreams
    control.publish(1, e1, e2)
    control.set_loads(
        [
            {"endpoint_id": "e1-replica", "running": 8, "waiting": 40, "kv_cache_usage": 0.9},
            {"endpoint_id": "e2-replica", "running": 1, "waiting": 0, "kv_cache_usage": 0.1},
        ]
    )
    router = spawn_router(config(control, load_reports={"max_age": "1s"}))
    wait_for(
        lambda: endpoint(router, "e1-replica")["engine"] is not None,
        what="e1's load figures at the router",
    )
    e1_view = endpoint(router, "e1-replica")
    assert e1_view["engine"]["waiting"] == 40
    assert e1_view["engine"]["running"] == 8
    assert e1_view["load_source"] == "engine"
    metrics = router.metrics()
    assert 'llmgw_router_engine_waiting{endpoint="e1-replica"} 40.0' in metrics
    assert 'llmgw_router_endpoint_load{endpoint="e2-replica",source="engine"}' in metrics
    # e1 is far above the mean: every prefix, whichever endpoint it hashes to, goes to e2.
    assert {served_by(router, prompt(t)) for t in range(10)} == {"e2"}

    # The reports stop: after max_age the figures are unknown and the router balances on
    # its own counts again, so prefixes go where they hash, both endpoints.
    control.set_loads(None)
    wait_for(
        lambda: endpoint(router, "e1-replica")["load_source"] == "router",
        what="e1's figures stale",
    )
    assert endpoint(router, "e1-replica")["engine"] is None
    assert {served_by(router, prompt(t)) for t in range(12)} == {"e1", "e2"}


def test_a_router_that_loses_the_control_plane_keeps_routing(
    spawn_router: Spawn, upstreams: list[Upstream], control: Any
) -> None:
    e1, e2 = upstreams
    control.publish(1, e1, e2)
    control.set_loads(
        [
            {"endpoint_id": "e1-replica", "running": 0, "waiting": 30},
            {"endpoint_id": "e2-replica", "running": 0, "waiting": 0},
        ]
    )
    router = spawn_router(config(control))
    wait_for(lambda: endpoint(router, "e1-replica")["load_source"] == "engine", what="load figures")
    control.stop()
    wait_for(lambda: "control plane stream lost" in router.proc.output(), what="loss noticed")
    # The engines' figures are dropped at once: its own counts (both idle) now.
    assert {ep["load_source"] for ep in router.endpoints()["endpoints"]} == {"router"}
    assert {served_by(router, prompt(t)) for t in range(12)} == {"e1", "e2"}
    assert httpx.get(router.admin + "/readyz").status_code == 200


def test_a_standby_sends_the_router_to_the_leader(
    spawn_router: Spawn, upstreams: list[Upstream], control: Any, tmp_path: Path
) -> None:
    e1, _ = upstreams
    control.publish(3, e1)
    standby = type(control)(free_port(), tmp_path / "standby.json", tmp_path)
    standby.leader = control.address
    standby.start()
    try:
        cfg = config(control)
        cfg["control"] = {**cfg["control"], "address": "", "addresses": [standby.address]}
        router = spawn_router(cfg)
        assert router.endpoints()["version"] == 3
        assert (
            served_by(router, {"model": "m1", "messages": [{"role": "user", "content": "hi"}]})
            == "e1"
        )
        assert "refused as standby" in standby.output()
        assert "following the control plane's leader" in router.proc.output()
        assert router.endpoints()["control"]["address"] == control.address
    finally:
        standby.stop()


async def test_requests_for_a_model_at_zero_are_held_until_it_starts(
    spawn_router: Spawn, spawn_upstream: Spawn, control: Any
) -> None:
    declared = [{"name": "m5", "scale_to_zero": True}]
    control.publish(1, model="m5", models=declared)
    router = await asyncio.to_thread(
        spawn_router, config(control, hold={"hold_timeout": "60s"}), wait_ready=False
    )
    async with httpx.AsyncClient(timeout=90) as http:
        await asyncio.to_thread(
            wait_for,
            lambda: httpx.get(router.admin + "/v1/endpoints").json()["declared"] == {"m5": True},
            what="snapshot with the declared model",
        )
        listed = (await http.get(router.url + "/v1/models")).json()["data"]
        assert [m["id"] for m in listed] == ["m5"]
        body = {"model": "m5", "messages": [{"role": "user", "content": "hi"}]}
        held = [
            asyncio.create_task(http.post(router.url + "/v1/chat/completions", json=body))
            for _ in range(20)
        ]
        await asyncio.to_thread(
            wait_for,
            lambda: httpx.get(router.admin + "/v1/endpoints").json()["held"] == {"m5": 20},
            what="20 requests held",
        )
        await asyncio.to_thread(control.proc.wait_output, "demand model=m5 held=")
        assert not any(t.done() for t in held)
        up = await asyncio.to_thread(spawn_upstream, "z1", ["m5"])
        control.publish(2, up, model="m5", models=declared)
        answers = await asyncio.gather(*held)
    assert [r.status_code for r in answers] == [200] * 20
    assert {r.headers["x-sim-name"] for r in answers} == {"z1"}


def test_hold_timeout_is_a_503_with_retry_after(spawn_router: Spawn, control: Any) -> None:
    control.publish(1, model="m5", models=[{"name": "m5", "scale_to_zero": True}])
    router = spawn_router(config(control, hold={"hold_timeout": "1s"}), wait_ready=False)
    wait_for(lambda: router.endpoints()["declared"] == {"m5": True}, what="declared model known")
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "m5", "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert r.status_code == 503
    assert int(r.headers["retry-after"]) >= 1
    error = r.json()["error"]
    assert error["code"] == "model_starting"
    assert "no replica became ready within 1s" in error["message"]


def test_an_engine_restart_clears_that_engines_prefix_state(
    spawn_router: Spawn, upstreams: list[Upstream], control: Any
) -> None:
    e1, e2 = upstreams
    control.publish(1, e1, e2, generations={"e1": 1, "e2": 1})
    router = spawn_router(config(control))
    served = {served_by(router, prompt(t)) for t in range(8)}
    assert served == {"e1", "e2"}
    assert endpoint(router, "e1-replica")["prefix_blocks"] > 0
    e2_blocks = endpoint(router, "e2-replica")["prefix_blocks"]
    assert e2_blocks > 0
    # e1's engine restarted (a new generation at the same URL): what was sent there is
    # no longer in its cache; e2 keeps its prefix state.
    control.publish(2, e1, e2, generations={"e1": 2, "e2": 1})
    wait_for(lambda: router.endpoints()["version"] == 2, what="snapshot 2")
    assert endpoint(router, "e1-replica")["generation"] == 2
    assert endpoint(router, "e1-replica")["prefix_blocks"] == 0
    assert endpoint(router, "e2-replica")["prefix_blocks"] == e2_blocks


async def test_requests_without_a_first_byte_are_counted_until_it_comes(
    spawn_router: Spawn, spawn_upstream: Spawn
) -> None:
    """What a new request's first token waits behind: requests queued or in prefill. The
    router counts its own from the pick to the first byte, and shows the count."""
    # Wide windows (3 s to the first byte, then 20 chunks 0.5 s apart), each state seen
    # in one snapshot, so a loaded machine only waits longer.
    up = await asyncio.to_thread(
        spawn_upstream, "slow", ["m1"], "--sim-ttft", "3", "--sim-itl", "0.5"
    )
    router = await asyncio.to_thread(
        spawn_router, {"endpoints": [up.entry(["m1"])], "health_checks": {"enabled": False}}
    )

    def view() -> dict[str, Any]:
        return endpoint(router, "slow")

    def seen(waiting: int, outstanding: int) -> bool:
        v = view()
        return bool(v["awaiting_first_byte"] == waiting and v["outstanding"] == outstanding)

    body = {**prompt(1), "stream": True, "max_tokens": 20}
    first = asyncio.Event()

    async def stream() -> int:
        async with (
            httpx.AsyncClient(timeout=60) as http,
            http.stream("POST", router.url + "/v1/chat/completions", json=body) as r,
        ):
            # The router answers with the engine's first byte (after its 3 s).
            first.set()
            chunks = [chunk async for chunk in r.aiter_bytes()]
            assert b"[DONE]" in b"".join(chunks)
            return r.status_code

    task = asyncio.create_task(stream())
    await asyncio.to_thread(wait_for, lambda: seen(1, 1), what="in flight, no first byte")
    assert not first.is_set()
    await asyncio.wait_for(first.wait(), 30)
    # Generating: in flight, no longer waiting for a first byte.
    await asyncio.to_thread(wait_for, lambda: seen(0, 1), what="in flight, generating")
    assert not task.done()
    assert await task == 200
    await asyncio.to_thread(wait_for, lambda: view()["outstanding"] == 0, what="finished")
    assert view()["awaiting_first_byte"] == 0
    assert view()["finished_since_report"] == 0  # no engine figures: nothing to correct
