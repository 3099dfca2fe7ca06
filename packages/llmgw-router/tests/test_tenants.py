"""Tenants through a router process: per-key limits with OpenAI's headers (and the
official openai client backing off on them), fair share and priority when the engines
are full, and keys and shares from a control plane (WatchKeys, ReportUsage)."""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading
from collections.abc import Callable
from typing import Any

import httpx
import openai
from llmgw_testkit import wait_for

Spawn = Callable[..., Any]
CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def bearer(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_rpm_refusal_carries_openai_headers_and_the_sdk_retries(
    spawn_upstream: Spawn, spawn_router: Spawn
) -> None:
    up = spawn_upstream("e1", ["m1"])
    router = spawn_router(
        {
            "endpoints": [up.entry(["m1"])],
            "api_keys": [
                {"key": "sk-limited", "name": "team-a", "rpm": 12, "tpm": 100000},
                {"key": "sk-open", "name": "team-b"},
            ],
        }
    )
    url = router.url + "/v1/chat/completions"
    with httpx.Client(timeout=30) as http:
        for i in range(12):
            r = http.post(url, json=CHAT, headers=bearer("sk-limited"))
            assert r.status_code == 200, r.text
            assert r.headers["x-ratelimit-limit-requests"] == "12"
            assert r.headers["x-ratelimit-remaining-requests"] == str(11 - i)
            assert r.headers["x-ratelimit-limit-tokens"] == "100000"
            assert re.fullmatch(r"\d+(ms|s)|\d+m\d+s", r.headers["x-ratelimit-reset-requests"])
        # The bucket is empty: refused before any engine sees it.
        started = up.stats()["started"]
        r = http.post(url, json=CHAT, headers=bearer("sk-limited"))
        assert r.status_code == 429
        error = r.json()["error"]
        assert error["code"] == "rate_limit_exceeded"
        assert "team-a" in error["message"]
        assert "12 requests per minute" in error["message"]
        assert "sk-limited" not in r.text
        assert 1 <= int(r.headers["retry-after"]) <= 5
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        assert "x-ratelimit-reset-tokens" in r.headers
        assert up.stats()["started"] == started
        # A key without limits gets no rate-limit headers, and is not refused.
        r = http.post(url, json=CHAT, headers=bearer("sk-open"))
        assert r.status_code == 200
        assert "x-ratelimit-limit-requests" not in r.headers

    # The official client, its retries on as users run it: it waits as Retry-After says
    # and its retry goes through.
    client = openai.OpenAI(
        base_url=router.url + "/v1", api_key="sk-limited", max_retries=4, timeout=60
    )
    raw = client.chat.completions.with_raw_response.create(
        model="m1", messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    assert raw.http_response.status_code == 200
    assert raw.retries_taken >= 1
    assert raw.parse().choices[0].message.content
    text = router.metrics()
    assert metric(text, "llmgw_router_key_refused_total", key="team-a", limit="rpm") >= 2
    assert metric(text, "llmgw_router_key_requests_total", key="team-a") == 13
    assert metric(text, "llmgw_router_key_requests_total", key="team-b") == 1
    assert metric(text, "llmgw_router_key_tokens_total", key="team-a", kind="completion") > 0


def _in_flight(router: Any) -> int:
    return int(router.endpoints()["tenants"]["queues"].get("m1", {}).get("in_flight", 0))


def _fire(
    url: str, secret: str, done: list[str], label: str, max_tokens: int = 2
) -> threading.Thread:
    def run() -> None:
        body = {**CHAT, "max_tokens": max_tokens}
        r = httpx.post(url, json=body, headers=bearer(secret), timeout=120)
        assert r.status_code == 200, r.text
        done.append(label)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _held(router: Any, key: str) -> int:
    tenants = router.endpoints()["tenants"]
    total = 0
    for queue in tenants["queues"].values():
        for band in queue["held"]:
            total += band["keys"].get(key, 0)
    return total


def _saturated_router(spawn_upstream: Spawn, spawn_router: Spawn) -> Any:
    # One request at a time at the engine (the router's cap); 50 ms a token.
    up = spawn_upstream("e1", ["m1"], "--sim-itl", "0.05")
    return spawn_router(
        {
            "endpoints": [up.entry(["m1"])],
            "tenants": {"queue": {"per_endpoint": 1, "max_wait": "120s"}},
            "api_keys": [
                {"key": "sk-flood", "name": "flood"},
                {"key": "sk-small", "name": "small"},
                {"key": "sk-bulk", "name": "bulk", "priority": "batch"},
                {"key": "sk-chat", "name": "chat", "priority": "interactive"},
            ],
        }
    )


def test_a_flooding_key_waits_behind_its_own_requests(
    spawn_upstream: Spawn, spawn_router: Spawn
) -> None:
    router = _saturated_router(spawn_upstream, spawn_router)
    url = router.url + "/v1/chat/completions"
    done: list[str] = []
    # The first holds the engine a while (200 tokens, 10 s: long enough on a loaded
    # machine), so that the rest queue behind it.
    threads = [_fire(url, "sk-flood", done, "flood0", max_tokens=200)]
    wait_for(lambda: _in_flight(router) == 1, timeout=60, what="the engine busy")
    threads += [_fire(url, "sk-flood", done, f"flood{i}") for i in range(1, 8)]
    # Seven held behind the one the engine has.
    wait_for(lambda: _held(router, "flood") == 7, timeout=60, what="flood held")
    text = router.metrics()
    assert metric(text, "llmgw_router_queue_length", priority="default", key="flood") == 7
    threads.append(_fire(url, "sk-small", done, "small"))
    wait_for(lambda: _held(router, "small") == 1 or "small" in done, timeout=60, what="small")
    for thread in threads:
        thread.join(timeout=120)
    assert len(done) == 9
    # FIFO would serve it last (9th); fair share serves it after at most one more flood
    # request than the one in flight.
    assert done.index("small") <= 2, done
    text = router.metrics()
    assert metric(text, "llmgw_router_queue_wait_seconds_count", key="small") == 1


def test_a_higher_band_goes_first(spawn_upstream: Spawn, spawn_router: Spawn) -> None:
    router = _saturated_router(spawn_upstream, spawn_router)
    url = router.url + "/v1/chat/completions"
    done: list[str] = []
    threads = [_fire(url, "sk-bulk", done, "bulk0", max_tokens=200)]
    wait_for(lambda: _in_flight(router) == 1, timeout=60, what="the engine busy")
    threads += [_fire(url, "sk-bulk", done, f"bulk{i}") for i in range(1, 6)]
    wait_for(lambda: _held(router, "bulk") == 5, timeout=60, what="bulk held")
    threads.append(_fire(url, "sk-chat", done, "chat"))
    for thread in threads:
        thread.join(timeout=120)
    assert len(done) == 7
    # Served next: after the batch request in flight only.
    assert done.index("chat") == 1, done


def test_keys_and_shares_from_the_control_plane(
    spawn_upstream: Spawn, spawn_router: Spawn, control: Any
) -> None:
    up = spawn_upstream("e1", ["m1"])
    control.publish(1, up)
    secret = "llmgw_0a1b2c3d_" + "s" * 32
    key = {
        "name": "team-c",
        "prefix": "llmgw_0a1b2c3d",
        "sha256": hashlib.sha256(secret.encode()).hexdigest(),
        "rpm": 600,
    }
    control.set_keys(1, [key])
    control.set_shares([{"key": "team-c", "rpm": 30.0}], valid_for=30.0)
    router = spawn_router(
        {
            "control": {
                "address": control.address,
                "tls": {"insecure": True},
                "router_id": "r1",
                "backoff_base": "100ms",
                "backoff_cap": "500ms",
            },
            "tenants": {"report_interval": "200ms"},
        }
    )
    url = router.url + "/v1/chat/completions"

    def status() -> int:
        return httpx.post(url, json=CHAT, headers=bearer(secret), timeout=30).status_code

    wait_for(lambda: status() == 200, timeout=30, what="the control plane's key accepted")
    assert httpx.post(url, json=CHAT, headers=bearer(secret + "x"), timeout=30).status_code == 401
    # The share from ReportUsage is this router's limit (30 of the key's 600).
    wait_for(
        lambda: (
            httpx.post(url, json=CHAT, headers=bearer(secret), timeout=30).headers.get(
                "x-ratelimit-limit-requests"
            )
            == "30"
        ),
        timeout=30,
        what="the share applied",
    )
    # Usage is reported, by key name, with an instance and growing sequence numbers.
    wait_for(
        lambda: (
            re.search(
                r"usage router_id=r1 instance=\w+ sequence=\d+ key=team-c requests=[1-9]",
                control.output(),
            )
            is not None
        ),
        timeout=30,
        what="usage reported",
    )
    assert secret not in control.output()
    # Revoked: refused within the deadline, with no restart.
    control.set_keys(2, [{**key, "revoked": True}])
    wait_for(lambda: status() == 401, timeout=10, what="the revoked key refused")
    # Back, then the control plane goes away: the router keeps its last key set.
    control.set_keys(3, [key])
    wait_for(lambda: status() == 200, timeout=10, what="the key back")
    control.stop()
    assert status() == 200


async def _race(url: str, secret: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60) as http:
        return list(
            await asyncio.gather(
                *(
                    http.post(url, json={**CHAT, "max_tokens": 10}, headers=bearer(secret))
                    for _ in range(n)
                )
            )
        )


def test_a_budget_raced_by_50_requests_ends_at_or_under_it(
    spawn_upstream: Spawn, spawn_router: Spawn
) -> None:
    up = spawn_upstream("e1", ["m1"], "--sim-itl", "0.02")
    budget = 400
    router = spawn_router(
        {
            "endpoints": [up.entry(["m1"])],
            "api_keys": [
                {
                    "key": "sk-budget",
                    "name": "capped",
                    "budget_tokens": budget,
                    "budget_period": "day",
                },
            ],
        }
    )
    answers = asyncio.run(_race(router.url + "/v1/chat/completions", "sk-budget", 50))
    ok = [r for r in answers if r.status_code == 200]
    refused = [r for r in answers if r.status_code == 429]
    assert len(ok) + len(refused) == 50
    assert ok
    assert refused
    assert {r.json()["error"]["code"] for r in refused} == {"insufficient_quota"}
    used = sum(r.json()["usage"]["total_tokens"] for r in ok)
    assert used <= budget
    text = router.metrics()
    counted = metric(text, "llmgw_router_key_tokens_total", key="capped", kind="prompt")
    counted += metric(text, "llmgw_router_key_tokens_total", key="capped", kind="completion")
    assert counted == used
