"""The router in front of the engine simulator (`llmgw-sim vllm serve`), as processes."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from llmgw_testkit import wait_for
from llmgw_testkit.checks import stream_chat_with_usage
from openai.types.chat import ChatCompletionMessageParam

Spawn = Callable[..., Any]
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def sse_events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def static_router(spawn_router: Spawn, engines: list[Any], **config: Any) -> Any:
    """A router whose endpoints come from `--endpoint` flags only."""
    flags: list[str] = []
    for engine in engines:
        flags += ["--endpoint", engine.flag()]
    return spawn_router({"health_checks": {"interval": "250ms"}, **config}, *flags)


def test_openai_streaming_with_usage_through_the_router(
    spawn_engines: Spawn, spawn_router: Spawn
) -> None:
    engines = spawn_engines(2)
    router = static_router(spawn_router, engines)
    got = stream_chat_with_usage(router.url, "m1", max_tokens=12, content="hello there")
    assert len(got.pieces) == 12
    assert got.chunks[-1].usage is not None
    assert got.chunks[-1].usage.completion_tokens == 12
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(
        model="m1", messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 5
    assert [m.id for m in client.models.list()] == ["m1"]
    statuses = {ep["id"]: ep["profile"] for ep in router.endpoints()["endpoints"]}
    assert statuses == {"sim0": "static", "sim1": "static"}


async def test_engine_killed_mid_load(spawn_engines: Spawn, spawn_router: Spawn) -> None:
    """Only requests that had started streaming may fail, and those end with an error event."""
    engines = spawn_engines(2, "--sim-itl", "0.01")
    router = await asyncio.to_thread(
        static_router, spawn_router, engines, ejection={"consecutive_failures": 1}
    )
    outcomes: list[str] = []

    async def one(http: httpx.AsyncClient) -> None:
        body = {"model": "m1", "stream": True, "max_tokens": 30, "messages": MESSAGES}
        async with http.stream("POST", router.url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                outcomes.append(f"status {resp.status_code}")
                return
            events = sse_events((await resp.aread()).decode())
        if events[-1] != "[DONE]":
            outcomes.append("truncated")
        elif any('"upstream_error"' in e for e in events):
            outcomes.append("cut")
        else:
            outcomes.append("ok")

    async def worker(http: httpx.AsyncClient) -> None:
        for _ in range(12):
            await one(http)

    async with httpx.AsyncClient(timeout=30) as http:
        workers = [asyncio.create_task(worker(http)) for _ in range(8)]
        while len(outcomes) < 16:
            await asyncio.sleep(0.02)
            assert not all(w.done() for w in workers)
        await asyncio.to_thread(engines[0].proc.stop, signal.SIGKILL)
        await asyncio.gather(*workers)
    assert len(outcomes) == 96
    assert set(outcomes) <= {"ok", "cut"}, outcomes
    # After the kill every new request went to the survivor.
    states = {ep["id"]: ep["state"] for ep in router.endpoints()["endpoints"]}
    assert states["sim1"] == "ready"
    assert states["sim0"] in {"ejected", "unhealthy"}


def test_client_disconnect_ends_the_engine_request(
    spawn_engines: Spawn, spawn_router: Spawn
) -> None:
    (engine,) = spawn_engines(1, "--sim-itl", "0.1")
    router = static_router(spawn_router, [engine])
    body = {"model": "m1", "stream": True, "max_tokens": 300, "messages": MESSAGES}
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        wait_for(lambda: engine.running() == 1, what="engine request running")
    # 300 tokens at 0.1 s take 30 s; the engine must stop long before that.
    wait_for(lambda: engine.running() == 0, timeout=15, what="engine request ended")
    wait_for(
        lambda: 'llmgw_router_client_disconnects_total{model="m1"} 1.0' in router.metrics(),
        what="disconnect counted",
    )


def test_stalled_stream_ends_with_an_error_event(spawn_engines: Spawn, spawn_router: Spawn) -> None:
    """After the first byte nothing can be retried: the idle deadline ends the stream in-band."""
    (engine,) = spawn_engines(1, "--sim-stall-after-tokens", "3")
    # The model's own deadline overrides the global one.
    router = static_router(
        spawn_router, [engine], deadlines={"idle": "60s"}, model_deadlines={"m1": {"idle": "1s"}}
    )
    body = {"model": "m1", "stream": True, "max_tokens": 20, "messages": MESSAGES}
    r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "upstream_error"
    assert "no data from sim0 for 1s" in error["message"]
    assert sum(1 for e in events if '"content"' in e) >= 3
    metrics = router.metrics()
    assert (
        'llmgw_router_upstream_errors_total{endpoint="sim0",reason="timeout_idle"} 1.0' in metrics
    )


def test_hypercorn_server_streams_and_cancels(spawn_engines: Spawn, spawn_router: Spawn) -> None:
    """`server: hypercorn` (the benchmark's comparison) serves the same app correctly."""
    (engine,) = spawn_engines(1, "--sim-itl", "0.05")
    router = static_router(spawn_router, [engine], server="hypercorn")
    got = stream_chat_with_usage(router.url, "m1", max_tokens=5, content="hi")
    assert got.chunks[-1].usage is not None
    assert got.chunks[-1].usage.completion_tokens == 5
    assert (
        "server=hypercorn" in router.proc.output()
        or '"server": "hypercorn"' in router.proc.output()
    )


def test_client_gone_before_the_first_token_ends_the_engine_request(
    spawn_engines: Spawn, spawn_router: Spawn
) -> None:
    """A client that leaves during a long prefill cancels the engine's request too."""
    (engine,) = spawn_engines(1, "--sim-ttft", "60")
    router = static_router(spawn_router, [engine])
    body = {"model": "m1", "stream": True, "max_tokens": 5, "messages": MESSAGES}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            router.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=2)
        )
    wait_for(lambda: engine.running() == 0, timeout=15, what="engine request ended")
    series = 'llmgw_router_client_disconnects_total{model="m1"} 1.0'
    wait_for(lambda: series in router.metrics(), what="disconnect counted")
