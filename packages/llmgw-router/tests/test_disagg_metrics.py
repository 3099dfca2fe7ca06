"""A disaggregated model's metrics and short prompts (issue 32, points 2 and 3), through a
real router in front of simulators speaking vLLM's disaggregated prefill protocol.

A long prompt goes through both phases: the pair is counted by both endpoints and each
phase's time observed; a failed prefill retried on the other prefill engine is counted; a
prompt under ``disagg.min_prompt_tokens`` goes to the decode engine alone, which prefills
it itself (no transfer). Which requests stay local is also checked as a property.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import httpx
from hypothesis import given
from hypothesis import strategies as st
from llmgw_router.proxy.disagg import BYTES_PER_TOKEN, local
from llmgw_testkit import wait_for

Router = Any
Upstream = Any

MIN_TOKENS = 64  # estimated: body bytes / 4


def kv(up: Upstream) -> dict[str, int]:
    return dict(httpx.get(up.url + "/sim/kv", timeout=5).json())


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text (0 when absent)."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def chat(router: Router, words: int) -> httpx.Response:
    content = " ".join(f"word{i}" for i in range(words))
    return httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4},
        timeout=30,
    )


def test_phases_pairs_retries_and_short_prompts_on_the_decode_engine(
    spawn_upstream: Callable[..., Upstream], spawn_router: Callable[..., Router]
) -> None:
    prefill = [spawn_upstream(f"p{i}", ["m"]) for i in (1, 2)]
    decode = spawn_upstream("d1", ["m"])
    entries = [up.entry(["m"], role="prefill", engine="vllm") for up in prefill]
    entries.append(decode.entry(["m"], role="decode", engine="vllm"))
    router = spawn_router({"endpoints": entries, "disagg": {"min_prompt_tokens": MIN_TOKENS}})

    # 1. A long prompt: prefill, then decode; the pair and each phase counted.
    r = chat(router, 200)
    assert r.status_code == 200, r.text
    assert r.headers.get("x-sim-name") == "d1"
    assert sum(kv(up)["kv_issued"] for up in prefill) == 1
    assert kv(decode)["kv_received"] == 1

    def phases_seen() -> str | None:
        text = router.metrics()
        count = "llmgw_router_disagg_phase_seconds_count"
        done = all(
            sample(text, count, model="m", phase=p) == 1 for p in ("prefill", "transfer", "decode")
        )
        return text if done else None

    text = wait_for(phases_seen, timeout=30, what="the three phases observed")
    pairs = "llmgw_router_disagg_pairs_total"
    served_by = [up.id for up in prefill if kv(up)["kv_issued"] == 1]
    assert sample(text, pairs, model="m", prefill=served_by[0], decode="d1") == 1
    assert sample(text, "llmgw_router_disagg_prefill_retries_total", model="m") == 0

    # 2. Both prefill engines fail once: the prefill is retried (three times: the other
    #    engine, then each again) and the answer still comes.
    for up in prefill:
        up.script(status=500, count=1)
    r = chat(router, 200)
    assert r.status_code == 200, r.text

    def second_pair() -> str | None:
        text = router.metrics()
        count = "llmgw_router_disagg_phase_seconds_count"
        return text if sample(text, count, model="m", phase="decode") == 2 else None

    text = wait_for(second_pair, timeout=30, what="the second pair counted")
    assert sample(text, "llmgw_router_disagg_prefill_retries_total", model="m") == 2
    assert sum(sample(text, pairs, model="m", prefill=up.id) for up in prefill) == 2

    # 3. A short prompt goes to the decode engine alone, which prefills it itself.
    started = sum(up.stats()["started"] for up in prefill)
    r = chat(router, 3)
    assert r.status_code == 200, r.text
    assert r.headers.get("x-sim-name") == "d1"
    assert sum(up.stats()["started"] for up in prefill) == started
    assert kv(decode)["kv_received"] == 2
    text = router.metrics()
    assert sample(text, "llmgw_router_disagg_local_total", model="m") == 1
    assert sample(text, "llmgw_router_disagg_phase_seconds_count", model="m", phase="decode") == 2


@given(
    size=st.integers(0, 1 << 20),
    engine=st.sampled_from(["vllm", "sglang", ""]),
    minimum=st.integers(0, 1 << 16),
)
def test_only_short_vllm_prompts_skip_the_prefill_engine(
    size: int, engine: str, minimum: int
) -> None:
    got = local(size, engine, minimum)
    if engine == "sglang" or minimum == 0:
        assert not got  # SGLang's decode engines take only transferred requests
    else:
        assert got == (size < minimum * BYTES_PER_TOKEN)


def test_local_examples() -> None:
    assert local(100, "vllm", 64)
    assert not local(64 * 4, "vllm", 64)
    assert not local(10, "sglang", 64)
    assert not local(10, "vllm", 0)
