"""The router's two-phase exchange (issue 32 point 3) against simulators that speak vLLM's
disaggregated prefill protocol (point 4), each its own process, through a real router.

A chat completion goes to a prefill engine (one token, not streamed, remote decode asked)
and then, with the transfer params the prefill engine issued, to a decode engine, which
verifies them; a decode engine refuses params no prefill engine issued; a prefill engine's
failure is retried on another. The request shaping is checked as properties as well.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
from hypothesis import given
from hypothesis import strategies as st
from llmgw_router.proxy.disagg import (
    REMOTE_DECODE,
    decode_params,
    sglang_body,
    vllm_decode_body,
    vllm_prefill_body,
)

# Fixtures from conftest.py; their classes cannot be imported under --import-mode=importlib.
Router = Any
Upstream = Any


def kv(up: Upstream) -> dict[str, int]:
    """The simulator's transfer counts (/sim/kv): kv_issued, kv_received, kv_refused."""
    return dict(httpx.get(up.url + "/sim/kv", timeout=5).json())


MESSAGES = [{"role": "user", "content": "Summarise the history of the lighthouse."}]


def _fleet(
    spawn_upstream: Callable[..., Upstream], spawn_router: Callable[..., Router]
) -> tuple[list[Upstream], Upstream, Router]:
    prefill = [spawn_upstream(f"p{i}", ["m"]) for i in (1, 2)]
    decode = spawn_upstream("d1", ["m"])
    entries = [up.entry(["m"], role="prefill", engine="vllm") for up in prefill]
    entries.append(decode.entry(["m"], role="decode", engine="vllm"))
    router = spawn_router({"endpoints": entries})
    return prefill, decode, router


def test_prefill_then_decode_refused_forgery_and_prefill_retry(
    spawn_upstream: Callable[..., Upstream], spawn_router: Callable[..., Router]
) -> None:
    prefill, decode, router = _fleet(spawn_upstream, spawn_router)

    # 1. Streamed: the prefill engine issued the transfer, the decode engine took it and
    #    streamed the answer back through the router.
    with httpx.stream(
        "POST",
        router.url + "/v1/chat/completions",
        json={"model": "m", "messages": MESSAGES, "max_tokens": 12, "stream": True},
        timeout=30,
    ) as r:
        assert r.status_code == 200
        assert r.headers.get("x-sim-name") == "d1"
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    text = "".join(
        json.loads(e[6:])["choices"][0]["delta"].get("content") or ""
        for e in events[:-1]
        if json.loads(e[6:])["choices"]
    )
    assert text
    assert sum(kv(up)["kv_issued"] for up in prefill) == 1
    assert (kv(decode)["kv_received"], kv(decode)["kv_refused"]) == (1, 0)
    assert decode.stats()["completed"] == 1
    assert sum(up.stats()["started"] for up in prefill) == 1

    # 2. Params no prefill engine issued: refused by the decode engine, naming why.
    forged = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "p1",
        "remote_block_ids": [0, 1],
        "remote_request_id": "chatcmpl-x",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "sim_signature": "0" * 64,
    }
    r2 = httpx.post(
        decode.url + "/v1/chat/completions",
        json={"model": "m", "messages": MESSAGES, "kv_transfer_params": forged},
        timeout=30,
    )
    assert r2.status_code == 400
    assert "not issued by a prefill engine" in r2.text
    assert kv(decode)["kv_refused"] == 1

    # 3. Both prefill engines fail their next request: the router tries the other prefill
    #    engine, then each again, and the client gets the answer from the decode engine.
    for up in prefill:
        up.script(status=500, count=1)
    r3 = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "m", "messages": MESSAGES, "max_tokens": 5},
        timeout=30,
    )
    assert r3.status_code == 200, r3.text
    assert r3.headers.get("x-sim-name") == "d1"
    assert sum(up.stats()["started"] for up in prefill) == 1 + 3  # two failed, one served
    assert sum(kv(up)["kv_issued"] for up in prefill) == 2
    assert kv(decode)["kv_received"] == 2


# --- the request shaping, as properties ---------------------------------------------------

bodies = st.fixed_dictionaries(
    {"model": st.text(min_size=1, max_size=8), "messages": st.just(MESSAGES)},
    optional={
        "stream": st.booleans(),
        "max_tokens": st.integers(1, 4096),
        "max_completion_tokens": st.integers(1, 4096),
        "stream_options": st.just({"include_usage": True}),
        "temperature": st.floats(0, 2),
    },
)


@given(body=bodies)
def test_the_prefill_request_asks_one_unstreamed_token_for_a_remote_decode(
    body: dict[str, Any],
) -> None:
    shaped = vllm_prefill_body(body)
    assert shaped["kv_transfer_params"] == REMOTE_DECODE
    assert shaped["stream"] is False
    assert shaped["max_tokens"] == 1
    assert shaped.get("max_completion_tokens", 1) == 1
    assert "stream_options" not in shaped
    changed = {"kv_transfer_params", "stream", "max_tokens", "max_completion_tokens"}
    assert all(shaped[k] == v for k, v in body.items() if k not in changed | {"stream_options"})
    assert body.get("kv_transfer_params") is None  # the original is not changed


@given(body=bodies, params=st.dictionaries(st.text(max_size=5), st.integers(), max_size=4))
def test_the_decode_request_is_the_original_with_the_issued_params(
    body: dict[str, Any], params: dict[str, Any]
) -> None:
    payload = json.dumps({"id": "x", "kv_transfer_params": params}).encode()
    got = decode_params(payload)
    assert got == params
    assert vllm_decode_body(body, params) == {**body, "kv_transfer_params": params}


def test_a_prefill_answer_without_params_says_so() -> None:
    assert "no kv_transfer_params" in str(decode_params(b'{"kv_transfer_params": null}'))
    assert "not JSON" in str(decode_params(b"<html>"))


@given(body=bodies, port=st.integers(1, 65535), room=st.integers(0, 2**63 - 1))
def test_sglang_both_engines_get_the_bootstrap_server_and_room(
    body: dict[str, Any], port: int, room: int
) -> None:
    shaped = sglang_body(body, "10.0.0.7", port, room)
    assert (shaped["bootstrap_host"], shaped["bootstrap_port"], shaped["bootstrap_room"]) == (
        "10.0.0.7",
        port,
        room,
    )
    assert {k: shaped[k] for k in body} == body
