"""Two router processes that never talk give every tenant the same engine when the
engines' caches are tight (issue 26.1): cache_aware's shared placement rule
(``cache_aware.shared_homes``), with real
routers, real simulated engines and real sockets.

Each engine's cache (``cache_tokens`` on its static endpoint) holds three of the twelve
tenants' system prompts; rendezvous hashing alone puts more than three on one engine,
so where a tenant goes depends on capacity. The routers see the tenants in opposite
orders (as a load balancer in front of a fleet of routers spreads them); before the
shared rule each placed a tenant by what it had itself sent so far (first come, first
placed) and the two disagreed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
from llmgw_router.balancing import CacheAware
from llmgw_router.balancing.prefix import prefix_blocks, prompt_text
from llmgw_testkit.candidates import Cand

Spawn = Callable[..., Any]
TENANTS = 12
BLOCK_BYTES = 64  # 16 tokens at the default 4 bytes per token
CACHE_BLOCKS = 112  # less the eighth left for requests in flight: three tenants of 32


def messages(tenant: int, turn: int) -> list[dict[str, str]]:
    system = f"You answer for tenant {tenant}. " + "Policy text. " * 150
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": f"question {turn}"},
    ]


def served_by(router: Any, tenant: int, turn: int) -> str:
    body = {"model": "m1", "messages": messages(tenant, turn), "max_tokens": 2}
    r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return str(r.headers["x-sim-name"])


def test_two_routers_agree_on_every_tenants_engine_in_tight_caches(
    spawn_upstream: Spawn, spawn_router: Spawn
) -> None:
    engines = [spawn_upstream(f"e{i}", ["m1"]) for i in range(4)]
    # What hashing alone would do: more tenants on one engine than its cache holds.
    plain = CacheAware[Cand]()
    cands = [Cand(e.id) for e in engines]
    first = Counter(
        plain.ranking(
            cands,
            prefix_blocks(
                prompt_text(msgspec.json.encode(messages(t, 0)), chat=True), BLOCK_BYTES, 256
            ),
        )[0].id
        for t in range(TENANTS)
    )
    assert max(first.values()) > 3, first
    config = {
        "endpoints": [e.entry(["m1"], cache_tokens=CACHE_BLOCKS * 16) for e in engines],
        "health_checks": {"enabled": False},
        "cache_aware": {"block_bytes": BLOCK_BYTES, "shared_homes": True},
    }
    a, b = spawn_router(config), spawn_router(config)
    for turn in (1, 2):
        for t in range(TENANTS):
            served_by(a, t, turn)
            served_by(b, TENANTS - 1 - t, turn)
    homes_a = {t: served_by(a, t, 3) for t in range(TENANTS)}
    homes_b = {t: served_by(b, t, 3) for t in range(TENANTS)}
    assert homes_a == homes_b
    # Within the caches: three tenants each.
    assert sorted(Counter(homes_a.values()).values()) == [3, 3, 3, 3]
    # And they stay.
    assert {t: served_by(b, t, 4) for t in range(TENANTS)} == homes_a
    assert {t: served_by(a, t, 4) for t in range(TENANTS)} == homes_a
