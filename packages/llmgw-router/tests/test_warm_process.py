"""Warming before a drain (issue 28 point 3) through a real router process: the scripted
control plane (llmgw_testkit.fake_control) marks one of two simulated engines leaving,
and the router sends the other one prefill-only requests for the prompts it sent the
leaving one, then sends it everything new."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
from llmgw_testkit import wait_for

Spawn = Callable[..., Any]


def sim_counter(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def router_sum(router: Any, name: str, label: str = "") -> float:
    total = 0.0
    for line in router.metrics().splitlines():
        if line.startswith(name) and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def prompt(i: int) -> str:
    # Distinct from the first byte, long enough for several prefix blocks.
    return f"tenant {i:03d} system prompt. " + ("lorem ipsum dolor sit amet " * 60)


def test_a_leaving_endpoint_has_its_hot_prompts_warmed_on_the_new_home(
    spawn_upstream: Spawn, spawn_router: Spawn, control: Any
) -> None:
    a = spawn_upstream("a", ["m1"])
    b = spawn_upstream("b", ["m1"])
    control.publish(1, a, b)
    router = spawn_router(
        {
            "control": {
                "address": control.address,
                "tls": {"insecure": True},
                "router_id": "router-under-test",
                "backoff_base": "100ms",
                "backoff_cap": "500ms",
            },
            "warming": {"max_requests": 4, "max_prefill_fraction": 0.5},
        }
    )
    served: dict[int, str] = {}
    with httpx.Client(timeout=60) as http:
        for _ in range(3):
            for i in range(12):
                r = http.post(
                    router.url + "/v1/completions",
                    json={"model": "m1", "prompt": prompt(i), "max_tokens": 4},
                )
                assert r.status_code == 200, r.text
                served[i] = r.headers["x-sim-name"]
        on_a = [i for i, name in served.items() if name == "a"]
        assert on_a, served
        a_started = a.stats()["started"]
        b_started = b.stats()["started"]
        b_generated = sim_counter(b.url, "vllm:generation_tokens_total")

        control.publish(2, a, b, leaving={"a"})
        want = min(4, len(on_a))
        wait_for(
            lambda: router_sum(router, "llmgw_router_warm_requests_total") >= want,
            timeout=60,
            what=f"{want} warm requests",
        )
        assert router_sum(router, "llmgw_router_warm_requests_total", 'outcome="ok"') == want
        # Each was a prefill-only request (one token) to the inheriting engine, none to
        # the leaving one.
        wait_for(lambda: b.stats()["started"] == b_started + want, timeout=30, what="warmed")
        assert sim_counter(b.url, "vllm:generation_tokens_total") == b_generated + want
        assert a.stats()["started"] == a_started
        # Bounded: the warm prompts' tokens within half of what was sent to a to prefill.
        warm_tokens = router_sum(router, "llmgw_router_warm_prompt_tokens_total")
        sent_to_a = sum(len(prompt(i)) // 4 for i in on_a) * 3
        assert 0 < warm_tokens <= 0.5 * sent_to_a

        # New requests go to the staying engine, a's hot prompts included.
        for i in on_a:
            r = http.post(
                router.url + "/v1/completions",
                json={"model": "m1", "prompt": prompt(i), "max_tokens": 4},
            )
            assert r.status_code == 200
            assert r.headers["x-sim-name"] == "b"
        assert a.stats()["started"] == a_started


def _join_run(spawn_upstream: Spawn, spawn_router: Spawn, control: Any, enabled: bool) -> bool:
    """Two engines serve 12 prompts; a third joins. Sends the prompts until the newcomer
    serves one; whether every request it served hit its prefix cache (and, with warming,
    that it was sent one-token copies first)."""
    a = spawn_upstream("a", ["m1"])
    b = spawn_upstream("b", ["m1"])
    control.publish(1, a, b)
    router = spawn_router(
        {
            "control": {
                "address": control.address,
                "tls": {"insecure": True},
                "router_id": "router-under-test",
                "backoff_base": "100ms",
                "backoff_cap": "500ms",
            },
            "warming": {"enabled": enabled, "max_requests": 32, "max_prefill_fraction": 1.0},
        }
    )
    hits, queries = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
    with httpx.Client(timeout=60) as http:

        def send(i: int) -> str:
            r = http.post(
                router.url + "/v1/completions",
                json={"model": "m1", "prompt": prompt(i), "max_tokens": 4},
            )
            assert r.status_code == 200, r.text
            return str(r.headers["x-sim-name"])

        for _ in range(2):
            for i in range(12):
                send(i)
        c = spawn_upstream("c", ["m1"])
        control.publish(2, a, b, c)
        if enabled:
            wait_for(
                lambda: router_sum(router, "llmgw_router_warm_requests_total") >= 1,
                timeout=30,
                what="the newcomer's first warm copy",
            )
            # Only the newcomer is warmed, one-token copies each.
            warmed = router_sum(router, "llmgw_router_warm_requests_total")
            assert c.stats()["started"] >= 1
        all_hits = True
        served_by_c = 0

        def round_served_by_c() -> bool:
            nonlocal all_hits, served_by_c
            for i in range(12):
                before = sim_counter(c.url, hits), sim_counter(c.url, queries)
                if send(i) != "c":
                    continue
                served_by_c += 1
                got = sim_counter(c.url, hits) - before[0]
                asked = sim_counter(c.url, queries) - before[1]
                if got < 0.8 * asked:
                    all_hits = False
            return served_by_c > 0

        wait_for(round_served_by_c, timeout=60, what="a request served by the newcomer")
        if enabled:
            warmed = router_sum(router, "llmgw_router_warm_requests_total")
            assert router_sum(router, "llmgw_router_warm_requests_total", 'outcome="ok"') == warmed
            assert sim_counter(c.url, "vllm:generation_tokens_total") >= warmed
        return all_hits


def test_a_joining_endpoint_is_warmed_before_it_takes_its_prefixes(
    spawn_upstream: Spawn, spawn_router: Spawn, control: Any
) -> None:
    assert _join_run(spawn_upstream, spawn_router, control, enabled=True)


def test_without_warming_a_joining_endpoint_takes_its_prefixes_cold(
    spawn_upstream: Spawn, spawn_router: Spawn, control: Any
) -> None:
    # What the test above guards: the newcomer is its prefixes' first rendezvous choice,
    # and cache_aware moves them there at once, each a miss.
    assert not _join_run(spawn_upstream, spawn_router, control, enabled=False)
