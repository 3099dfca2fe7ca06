"""Resumed non-streamed answers through a real router process (issue 28 point 1): a
non-streamed chat or text completion is asked of the engine as a stream and gathered
into one JSON answer, so when its engine is SIGKILLed mid-generation the answer is
resumed on the other replica and equals the uninterrupted one (the simulator is
greedy); with every replica killed, an error answer in OpenAI's shape (502)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from signal import SIGKILL
from typing import Any

import httpx
import pytest
from llmgw_testkit import wait_for

# Fixtures from conftest.py; their classes cannot be imported under --import-mode=importlib.
Router = Any
Upstream = Any

MESSAGES = [{"role": "user", "content": "Tell me a long story about the sea."}]
# 6 s of generation at the simulator's 50 ms a token: after the 10 chunks the kill waits
# for, time enough to find the serving engine on a loaded machine (at 40 tokens an engine
# once finished first, at load average ~10).
TOKENS = 120


def _metric(router: Router, name: str, **labels: str) -> float:
    total = 0.0
    for line in router.metrics().splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _generated(up: Upstream) -> float:
    """The tokens an engine has generated for answers it finished."""
    total = 0.0
    for line in httpx.get(up.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:generation_tokens_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _fleet(
    spawn_upstream: Callable[..., Upstream],
    spawn_router: Callable[..., Router],
    gather: bool = True,
) -> tuple[list[Upstream], Router]:
    ups = [spawn_upstream(f"r{i}", ["m1"], "--sim-itl", "0.05") for i in range(2)]
    router = spawn_router(
        {
            "endpoints": [up.entry(["m1"]) for up in ups],
            "balancer": "round_robin",
            "health_checks": {"interval": "200ms"},
            "retries": {"resume_unstreamed": gather},
        }
    )
    wait_for(
        lambda: all(ep["state"] == "ready" for ep in router.endpoints()["endpoints"]),
        what="endpoints ready",
    )
    return ups, router


def _post_killing(
    router: Router, path: str, body: dict[str, Any], ups: list[Upstream], kill: str
) -> tuple[httpx.Response, list[Upstream]]:
    """Post ``body`` (not streamed) through the router; once the router has passed on 10
    chunks of the engine's stream, SIGKILL the engine serving it (``kill="serving"``) or
    every engine (``kill="all"``). Returns the answer and the engines left."""
    result: list[httpx.Response] = []
    failed: list[BaseException] = []

    def post() -> None:
        try:
            result.append(httpx.post(router.url + path, json=body, timeout=60))
        except BaseException as err:
            failed.append(err)

    chunks = "llmgw_router_inter_chunk_gap_seconds_count"
    before = _metric(router, chunks, model="m1")
    thread = threading.Thread(target=post)
    thread.start()
    try:
        wait_for(
            lambda: _metric(router, chunks, model="m1") >= before + 10 or not thread.is_alive(),
            timeout=30,
            what="10 chunks relayed",
        )
        assert thread.is_alive(), "the answer came before the engine was killed"
        serving = [up for up in ups if up.stats()["in_flight"] > 0]
        assert len(serving) == 1
        killed = ups if kill == "all" else serving
        for up in killed:
            up.proc.signal(SIGKILL)
            up.proc.wait(10)
    finally:
        thread.join(90)
    assert not failed, failed
    return result[0], [up for up in ups if up not in killed]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_unstreamed_answer_resumed_after_its_engine_is_killed(
    spawn_upstream: Callable[..., Upstream], spawn_router: Callable[..., Router], path: str
) -> None:
    ups, router = _fleet(spawn_upstream, spawn_router)
    chat = path == "/v1/chat/completions"
    body: dict[str, Any] = {"model": "m1", "max_tokens": TOKENS}
    body.update({"messages": MESSAGES} if chat else {"prompt": "Once upon a time"})
    want = httpx.post(ups[0].url + path, json=body, timeout=30).json()
    generated = {up.id: _generated(up) for up in ups}
    r, (survivor,) = _post_killing(router, path, body, ups, kill="serving")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    got = r.json()
    assert got["object"] == want["object"]
    choice, expected = got["choices"][0], want["choices"][0]
    if chat:
        assert choice["message"]["content"] == expected["message"]["content"]
        assert choice["message"]["role"] == "assistant"
    else:
        assert choice["text"] == expected["text"]
    assert choice["finish_reason"] == expected["finish_reason"] == "length"
    assert got["usage"]["completion_tokens"] == TOKENS
    # The client's prompt: the continuation's less the tokens it was given, up to how
    # the engine tokenizes the seam.
    assert abs(got["usage"]["prompt_tokens"] - want["usage"]["prompt_tokens"]) <= 2
    assert got["model"] == "m1"
    assert _metric(router, "llmgw_router_resumes_total", model="m1") == 1
    # The survivor continued the answer rather than generating it again: the killed
    # engine's (at least 9) tokens were not generated twice.
    assert _generated(survivor) - generated[survivor.id] <= TOKENS - 9


def test_every_replica_killed_answers_an_openai_error(
    spawn_upstream: Callable[..., Upstream], spawn_router: Callable[..., Router]
) -> None:
    ups, router = _fleet(spawn_upstream, spawn_router)
    body = {"model": "m1", "messages": MESSAGES, "max_tokens": TOKENS}
    r, _ = _post_killing(router, "/v1/chat/completions", body, ups, kill="all")
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["type"] == "upstream_error"
    assert error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (
        _metric(router, "llmgw_router_resume_failures_total", model="m1", reason="retries_spent")
        + _metric(router, "llmgw_router_resume_failures_total", model="m1", reason="no_replica")
        == 1
    )
    assert _metric(router, "llmgw_router_requests_total", model="m1", status="502") == 1


def test_unstreamed_answers_are_not_gathered_by_default(
    spawn_upstream: Callable[..., Upstream], spawn_router: Callable[..., Router]
) -> None:
    """Gathering is opt-in (it costs a stream's relaying): by default a non-streamed
    request goes to the engine as it is, and no chunk of it is relayed."""
    _, router = _fleet(spawn_upstream, spawn_router, gather=False)
    chunks = "llmgw_router_inter_chunk_gap_seconds_count"
    before = _metric(router, chunks, model="m1")
    body = {"model": "m1", "max_tokens": 10, "messages": MESSAGES}
    r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 10
    assert _metric(router, chunks, model="m1") == before
    gathered_body = {**body, "stream": True}
    r = httpx.post(router.url + "/v1/chat/completions", json=gathered_body, timeout=30)
    assert r.status_code == 200
    assert _metric(router, chunks, model="m1") > before
