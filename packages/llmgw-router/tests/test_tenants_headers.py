"""Every response for a limited key carries OpenAI's x-ratelimit-* headers, the router's
own errors from the stages after admission included (an engine it cannot reach, a
request held past its deadline, a model it does not serve): router processes, real
sockets, the simulated engine."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from typing import Any

import httpx
from llmgw_testkit import free_port, wait_for

Spawn = Callable[..., Any]
KEYS = [
    {"key": "sk-limited", "name": "team-a", "rpm": 100, "tpm": 100000},
    {"key": "sk-open", "name": "team-b"},
]
CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def _limited(r: httpx.Response) -> None:
    assert r.headers.get("x-ratelimit-limit-requests") == "100", (r.status_code, r.headers)
    assert r.headers.get("x-ratelimit-limit-tokens") == "100000"
    assert "x-ratelimit-remaining-requests" in r.headers
    assert "x-ratelimit-reset-tokens" in r.headers


def test_an_engine_out_of_reach_and_an_unknown_model(spawn_router: Spawn) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    router = spawn_router(
        {
            "endpoints": [{"id": "dead", "url": dead, "models": ["m1"]}],
            "health_checks": {"enabled": False},
            "api_keys": KEYS,
        }
    )
    url = router.url + "/v1/chat/completions"
    with httpx.Client(timeout=60) as http:
        r = http.post(url, json=CHAT, headers={"authorization": "Bearer sk-limited"})
        assert r.status_code in (502, 503, 504), r.text
        assert r.json()["error"]["message"]
        _limited(r)
        r = http.post(
            url,
            json={**CHAT, "model": "nope"},
            headers={"authorization": "Bearer sk-limited"},
        )
        assert 400 <= r.status_code < 500, r.text
        _limited(r)
        # A key without limits: none.
        r = http.post(url, json=CHAT, headers={"authorization": "Bearer sk-open"})
        assert r.status_code in (502, 503, 504)
        assert "x-ratelimit-limit-requests" not in r.headers
    # The key's name (never its secret) on the request's log lines.
    failed = _log_lines(router, "upstream attempt failed")
    assert {line.get("key") for line in failed} == {"team-a", "team-b"}
    assert "sk-limited" not in router.proc.log_path.read_text()


def _log_lines(router: Any, event: str) -> list[dict[str, Any]]:
    out = []
    for raw in router.proc.log_path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            line = json.loads(raw)
            if isinstance(line, dict) and line.get("event") == event:
                out.append(line)
    return out


def test_a_request_held_past_its_deadline(spawn_upstream: Spawn, spawn_router: Spawn) -> None:
    up = spawn_upstream("e1", ["m1"], "--sim-itl", "0.05")
    router = spawn_router(
        {
            "endpoints": [up.entry(["m1"])],
            "tenants": {"queue": {"per_endpoint": 1, "max_wait": "1s"}},
            "api_keys": KEYS,
        }
    )
    url = router.url + "/v1/chat/completions"
    first: list[int] = []

    def long_one() -> None:
        r = httpx.post(
            url,
            json={**CHAT, "max_tokens": 80},
            headers={"authorization": "Bearer sk-open"},
            timeout=120,
        )
        first.append(r.status_code)

    thread = threading.Thread(target=long_one, daemon=True)
    thread.start()
    try:
        wait_for(
            lambda: router.endpoints()["tenants"]["queues"].get("m1", {}).get("in_flight") == 1,
            timeout=30,
            what="the first request in flight",
        )
        r = httpx.post(url, json=CHAT, headers={"authorization": "Bearer sk-limited"}, timeout=60)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "overloaded"
        assert r.headers["retry-after"]
        _limited(r)
    finally:
        thread.join(timeout=60)
    assert first == [200]


def test_no_usable_endpoint_after_admission_carries_the_lines_once(spawn_router: Spawn) -> None:
    """The router's own 503 raised once the request is admitted (its only engine ejected
    after one failure, no panic): the key's lines come once, in the error's own list,
    not also in the head the router's server writes for an admitted request."""
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    router = spawn_router(
        {
            "endpoints": [{"id": "dead", "url": dead, "models": ["m1"]}],
            "health_checks": {"enabled": False},
            "ejection": {"consecutive_failures": 1, "panic_threshold": 0},
            "api_keys": KEYS,
        }
    )
    url = router.url + "/v1/chat/completions"
    auth = {"authorization": "Bearer sk-limited"}
    with httpx.Client(timeout=60) as http:
        r = http.post(url, json=CHAT, headers=auth)
        assert r.status_code == 502, r.text
        _limited(r)
        r = http.post(url, json=CHAT, headers=auth)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "no_usable_endpoint"
        _limited(r)
        names = [name for name, _ in r.headers.raw if name.startswith(b"x-ratelimit-")]
        assert len(names) == len(set(names)) == 6, r.headers.raw
