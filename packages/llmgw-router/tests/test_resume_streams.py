"""Resumed streams through a real router process (issue 28 point 1): the engine serving a
stream is SIGKILLed (or stalls past the idle deadline) mid-answer, and the client still
reads one unbroken stream whose text equals the uninterrupted answer (the simulator is
greedy: its text is a function of the prompt), with the first id, one role chunk and the
usage of the whole answer; with no replica left, the error event as before."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from signal import SIGKILL
from typing import Any

import httpx
from llmgw_testkit import wait_for

# Fixtures from conftest.py; their classes cannot be imported under --import-mode=importlib.
Router = Any
Upstream = Any

MESSAGES = [{"role": "user", "content": "Tell me a long story about the sea."}]


def _metric(router: Router, name: str, **labels: str) -> float:
    total = 0.0
    for line in router.metrics().splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _reference(up: Upstream, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The uninterrupted answer, from an engine directly."""
    plain = {k: v for k, v in body.items() if k != "stream_options"}
    r = httpx.post(up.url + path, json={**plain, "stream": False}, timeout=30)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _stream(
    router: Router,
    path: str,
    body: dict[str, Any],
    ups: dict[str, Upstream],
    kill_after: int | None,
    also_kill: list[Upstream] = (),  # type: ignore[assignment]
) -> tuple[list[dict[str, Any]], list[bytes]]:
    """Stream through the router; after ``kill_after`` chunks SIGKILL the engine serving
    it (``x-sim-name``), and ``also_kill`` first."""
    chunks: list[dict[str, Any]] = []
    raw: list[bytes] = []
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", router.url + path, json={**body, "stream": True}) as r,
    ):
        assert r.status_code == 200
        serving = ups[r.headers["x-sim-name"]]
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            raw.append(line.encode())
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
            if kill_after is not None and len(chunks) == kill_after:
                for other in also_kill:
                    other.proc.signal(SIGKILL)
                    other.proc.wait(10)
                serving.proc.signal(SIGKILL)
    return chunks, raw


def _text(chunks: list[dict[str, Any]]) -> str:
    out = []
    for c in chunks:
        for ch in c.get("choices") or ():
            delta = ch.get("delta")
            out.append((delta.get("content") if delta else ch.get("text")) or "")
    return "".join(out)


def _fleet(
    spawn_upstream: Callable[..., Upstream],
    spawn_router: Callable[..., Router],
    n: int,
    *sim: str,
    **config: Any,
) -> tuple[dict[str, Upstream], Router]:
    ups = {f"r{i}": spawn_upstream(f"r{i}", ["m1"], "--sim-itl", "0.03", *sim) for i in range(n)}
    router = spawn_router(
        {
            "endpoints": [up.entry(["m1"]) for up in ups.values()],
            "balancer": "round_robin",
            "health_checks": {"interval": "200ms"},
            **config,
        }
    )
    wait_for(
        lambda: all(ep["state"] == "ready" for ep in router.endpoints()["endpoints"]),
        what="endpoints ready",
    )
    return ups, router


def test_chat_stream_resumed_after_its_engine_is_killed(
    spawn_upstream: Callable[..., Upstream], spawn_router: Callable[..., Router]
) -> None:
    ups, router = _fleet(spawn_upstream, spawn_router, 2)
    body = {
        "model": "m1",
        "messages": MESSAGES,
        "max_tokens": 40,
        "stream_options": {"include_usage": True},
    }
    want = _reference(ups["r0"], "/v1/chat/completions", body)
    chunks, raw = _stream(router, "/v1/chat/completions", body, ups, kill_after=12)
    assert _text(chunks) == want["choices"][0]["message"]["content"]
    assert len({c["id"] for c in chunks}) == 1
    assert len({c["created"] for c in chunks}) == 1
    roles = [c for c in chunks for ch in c["choices"] if ch["delta"].get("role")]
    assert len(roles) == 1
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 40
    # The client's prompt: the continuation's less the tokens it was given, up to how
    # the engine tokenizes the seam (here "\n" and " word" merge into one token).
    assert abs(chunks[-1]["usage"]["prompt_tokens"] - want["usage"]["prompt_tokens"]) <= 2
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]] == [
        "length"
    ]
    assert raw[-1] == b"data: [DONE]"
    assert not any(b'"error"' in line for line in raw)
    assert _metric(router, "llmgw_router_resumes_total", model="m1") == 1


def test_completion_stream_resumed_after_its_engine_is_killed(
    spawn_upstream: Callable[..., Upstream], spawn_router: Callable[..., Router]
) -> None:
    ups, router = _fleet(spawn_upstream, spawn_router, 2)
    body = {"model": "m1", "prompt": "Once upon a time", "max_tokens": 30}
    want = _reference(ups["r1"], "/v1/completions", body)
    chunks, _ = _stream(router, "/v1/completions", body, ups, kill_after=9)
    assert _text(chunks) == want["choices"][0]["text"]
    assert len({(c["id"], c["created"]) for c in chunks}) == 1
    assert _metric(router, "llmgw_router_resumes_total", model="m1") == 1


def test_stalled_stream_resumed_past_the_idle_deadline(
    spawn_upstream: Callable[..., Upstream], spawn_router: Callable[..., Router]
) -> None:
    """Every engine stops sending after 15 tokens (and keeps the connection open): each
    break is resumed on the other one, which gives 15 more, until the answer is whole."""
    ups, router = _fleet(
        spawn_upstream,
        spawn_router,
        2,
        "--sim-stall-after-tokens",
        "15",
        deadlines={"idle": "1s"},
        retries={"max_resumes": 3},
    )
    body = {"model": "m1", "messages": MESSAGES, "max_tokens": 40}
    whole = httpx.post(
        ups["r0"].url + "/v1/chat/completions", json={**body, "max_tokens": 14}, timeout=30
    ).json()["choices"][0]["message"]["content"]
    chunks, raw = _stream(router, "/v1/chat/completions", body, ups, kill_after=None)
    text = _text(chunks)
    # The first 14 tokens are the uninterrupted answer's; 40 tokens in all, no error.
    assert text.startswith(whole)
    assert len(re.findall(r" \w+", text)) == 40
    assert not any(b'"error"' in line for line in raw)
    assert _metric(router, "llmgw_router_resumes_total", model="m1") == 2


def test_no_replica_left_ends_with_the_error_event(
    spawn_upstream: Callable[..., Upstream], spawn_router: Callable[..., Router]
) -> None:
    ups, router = _fleet(spawn_upstream, spawn_router, 2)
    body = {"model": "m1", "messages": MESSAGES, "max_tokens": 40}
    chunks, raw = _stream(
        router, "/v1/chat/completions", body, ups, kill_after=5, also_kill=[ups["r0"], ups["r1"]]
    )
    assert raw[-1] == b"data: [DONE]"
    assert "error" in chunks[-1]
    assert chunks[-1]["error"]["type"] == "upstream_error"
    assert len(_text(chunks)) > 0
    assert (
        _metric(router, "llmgw_router_resume_failures_total", model="m1", reason="retries_spent")
        + _metric(router, "llmgw_router_resume_failures_total", model="m1", reason="no_replica")
        == 1
    )


def test_resumes_off_ends_with_the_error_event(
    spawn_upstream: Callable[..., Upstream], spawn_router: Callable[..., Router]
) -> None:
    ups, router = _fleet(spawn_upstream, spawn_router, 2, retries={"max_resumes": 0})
    body = {"model": "m1", "messages": MESSAGES, "max_tokens": 40}
    chunks, raw = _stream(router, "/v1/chat/completions", body, ups, kill_after=5)
    assert raw[-1] == b"data: [DONE]"
    assert "error" in chunks[-1]
    assert _metric(router, "llmgw_router_resumes_total", model="m1") == 0
