"""The proxy end to end: simulated engine processes (llmgw-sim), a real router process, real
clients."""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from llmgw_testkit import free_port, port_open, wait_for
from llmgw_testkit.checks import metric, stream_chat_with_usage

# Fixtures from conftest.py; their classes cannot be imported under --import-mode=importlib.
Router = Any
Upstream = Any
Spawn = Callable[..., Any]


def client(router: Router, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0, timeout=30)


def _async_true(condition: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return condition()

    return check


def sse_events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


TOKENS_M1 = 'llmgw_router_tokens_total{kind="completion",model="m1"}'


def test_openai_client_chat_completions_embeddings_and_models(
    router: Router, upstreams: list[Upstream]
) -> None:
    before = metric(router.metrics(), TOKENS_M1)
    c = client(router)
    e1 = upstreams[0].url
    chat = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    reply = c.chat.completions.create(**chat)  # type: ignore[call-overload]
    # The engine's own answer, relayed as it is (the simulated engines are deterministic).
    direct = httpx.post(e1 + "/v1/chat/completions", json=chat).json()
    assert reply.choices[0].message.content == direct["choices"][0]["message"]["content"]
    assert reply.choices[0].message.content
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 4
    raw = c.completions.with_raw_response.create(model="m2", prompt="hi", max_tokens=2)
    assert raw.headers["x-sim-name"] == "e1", "m2 is served by e1 only"
    direct = httpx.post(
        e1 + "/v1/completions", json={"model": "m2", "prompt": "hi", "max_tokens": 2}
    )
    assert raw.parse().choices[0].text == direct.json()["choices"][0]["text"]
    emb = c.embeddings.create(model="m1", input="hi")
    direct = httpx.post(e1 + "/v1/embeddings", json={"model": "m1", "input": "hi"})
    # The openai client asks for base64 and decodes float32s: the engine's, as float32.
    vector = direct.json()["data"][0]["embedding"]
    assert emb.data[0].embedding == list(
        struct.unpack(f"{len(vector)}f", struct.pack(f"{len(vector)}f", *vector))
    )
    assert sorted(m.id for m in c.models.list()) == ["m1", "m2"]
    metrics = router.metrics()
    assert metric(metrics, TOKENS_M1) == before + 4
    assert 'llmgw_router_time_to_first_token_seconds_count{model="m1"}' in metrics


def test_streaming_with_usage_through_openai_client(
    router: Router, upstreams: list[Upstream]
) -> None:
    for up in upstreams:
        up.script(itl=0.005)  # paced, so there are gaps between chunks to measure
    before = metric(router.metrics(), TOKENS_M1)
    got = stream_chat_with_usage(
        router.url, "m1", max_tokens=20, content="hi", api_key="unused", timeout=30
    )
    # The engine's own stream, relayed as it is (the simulated engines are deterministic).
    direct = stream_chat_with_usage(
        upstreams[0].url, "m1", max_tokens=20, content="hi", api_key="unused", timeout=30
    )
    assert got.deltas == direct.deltas
    assert len([d for d in got.deltas if d]) == 20
    assert got.chunks[-1].usage is not None
    assert got.chunks[-1].usage.completion_tokens == 20
    # Counted when the request ends, just after its last byte reached the client.
    metrics = wait_for(
        lambda: m if metric(m := router.metrics(), TOKENS_M1) == before + 20 else None,
        timeout=10,
        what="the 20 completion tokens counted",
    )
    assert 'llmgw_router_inter_chunk_gap_seconds_count{model="m1"}' in metrics


def test_stream_is_relayed_before_the_engine_finishes(
    router: Router, upstreams: list[Upstream]
) -> None:
    for up in upstreams:
        up.script(itl=0.05)
    body = {
        "model": "m1",
        "stream": True,
        "max_tokens": 60,
        "messages": [{"role": "user", "content": "hi"}],
    }
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        # vLLM's first chunk: the role.
        assert json.loads(first[6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        # The first chunk is here while the engine still generates: nothing was buffered.
        served = next(up for up in upstreams if up.id == resp.headers["x-sim-name"])
        assert served.stats()["in_flight"] == 1
        rest = list(lines)
    events = [first[6:], *sse_events("\n".join(rest))]
    assert events[-1] == "[DONE]"
    assert len(events) == 62  # the role, 60 tokens, [DONE]


def test_errors_are_openai_shaped(router: Router) -> None:
    url = router.url + "/v1/chat/completions"

    def error(resp: httpx.Response) -> dict[str, object]:
        detail = resp.json()["error"]
        assert set(detail) == {"message", "type", "param", "code"}
        return dict(detail)

    r = httpx.post(url, json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    assert error(r)["code"] == "model_not_found"
    r = httpx.post(url, content=b"{not json")
    assert r.status_code == 400
    assert error(r)["code"] == "invalid_json"
    r = httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    assert error(r)["param"] == "model"
    r = httpx.post(url, json=["model", "m1"])
    assert r.status_code == 400
    assert "JSON object" in str(error(r)["message"])
    r = httpx.post(url, json={"model": 7})
    assert r.status_code == 400
    assert error(r)["param"] == "model"
    r = httpx.post(
        url,
        json={
            "model": "m1",
            "messages": [{"role": "user", "content": "hi"}],
            "pad": "x" * (2 * 1024 * 1024),
        },
    )
    assert r.status_code == 413
    assert error(r)["code"] == "request_too_large"
    r = httpx.get(url)
    assert r.status_code == 405
    r = httpx.get(router.url + "/v2/other")
    assert r.status_code == 404
    error(r)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client(router).chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "hi"}]
        )
    assert (
        metric(router.metrics(), 'llmgw_router_requests_total{endpoint="",model="",status="404"}')
        >= 3
    )


def test_profile_pinning_and_unknown_profile(router: Router) -> None:
    url = router.url + "/v1/chat/completions"
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
    for profile, upstream in (("fast", "e1"), ("cheap", "e2")):
        served = {
            httpx.post(url, json=body, headers={"x-llmgw-profile": profile}).headers["x-sim-name"]
            for _ in range(10)
        }
        assert served == {upstream}
    r = httpx.post(url, json=body, headers={"x-llmgw-profile": "huge"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "profile_not_found"


def test_default_profile_is_preferred(spawn_router: Spawn, upstreams: list[Upstream]) -> None:
    e1, e2 = upstreams
    cfg = {
        "default_profile": "cheap",
        "endpoints": [e1.entry(["m1"], profile="fast"), e2.entry(["m1"], profile="cheap")],
        "health_checks": {"interval": "200ms"},
    }
    router = spawn_router(cfg)
    url = router.url + "/v1/chat/completions"
    served = {
        httpx.post(
            url, json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
        ).headers["x-sim-name"]
        for _ in range(10)
    }
    assert served == {"e2"}
    # Without a usable endpoint in the default profile, the others serve.
    e2.script(healthy=False)
    wait_for(
        lambda: router.endpoints()["endpoints"][1]["state"] == "unhealthy", what="e2 unhealthy"
    )
    assert (
        httpx.post(
            url, json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
        ).headers["x-sim-name"]
        == "e1"
    )


def test_session_affinity_keeps_a_session_on_one_endpoint(
    spawn_router: Spawn, upstreams: list[Upstream]
) -> None:
    e1, e2 = upstreams
    router = spawn_router(
        {
            "balancer": "session_affinity",
            "affinity": {"header": "x-session"},
            "endpoints": [e1.entry(["m1"]), e2.entry(["m1"])],
        }
    )
    url = router.url + "/v1/chat/completions"

    http = httpx.Client(timeout=30)

    def served(**kw: Any) -> set[str]:
        return {http.post(url, **kw).headers["x-sim-name"] for _ in range(6)}

    by_header = {
        s: served(
            json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-session": s},
        )
        for s in "abcdefgh"
    }
    assert all(len(ids) == 1 for ids in by_header.values()), by_header
    assert set().union(*by_header.values()) == {"e1", "e2"}, "sessions spread over both"
    for user in ("alice", "bob", "carol"):
        assert len(served(json={"model": "m1", "user": user})) == 1
    http.close()


def test_api_keys(spawn_router: Spawn, upstreams: list[Upstream]) -> None:
    e1, _ = upstreams
    router = spawn_router({"api_keys": ["sk-one", "sk-two"], "endpoints": [e1.entry(["m1"])]})
    with router.proc:
        url = router.url + "/v1/chat/completions"
        r = httpx.post(url, json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
        assert (
            httpx.post(
                url,
                json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]},
                headers={"authorization": "Bearer sk-bad"},
            ).status_code
            == 401
        )
        assert httpx.get(router.url + "/v1/models").status_code == 401
        reply = client(router, "sk-two").chat.completions.with_raw_response.create(
            model="m1", messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.headers["x-sim-name"] == "e1"
        with pytest.raises(openai.AuthenticationError):
            client(router, "sk-three").chat.completions.create(
                model="m1", messages=[{"role": "user", "content": "hi"}]
            )


def test_api_keys_file_and_per_key_model_allow_list(
    spawn_router: Spawn, upstreams: list[Upstream], tmp_path: Path
) -> None:
    e1, _ = upstreams  # e1 serves m1 and m2
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - sk-file-all\n  - {key: sk-only-m2, name: team-b, models: [m2]}\n")
    router = spawn_router(
        {
            "api_keys": [{"key": "sk-only-m1", "name": "team-a", "models": ["m1"]}],
            "api_keys_file": str(keys),
            "endpoints": [e1.entry(["m1", "m2"])],
        }
    )
    with router.proc:
        # A key from the file, with no allow-list, may use every model.
        for model in ("m1", "m2"):
            assert client(router, "sk-file-all").chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}]
            )
        # A limited key uses its models and is refused the others, with a clear error.
        assert client(router, "sk-only-m1").chat.completions.create(
            model="m1", messages=[{"role": "user", "content": "hi"}]
        )
        with pytest.raises(openai.PermissionDeniedError) as info:
            client(router, "sk-only-m2").chat.completions.create(
                model="m1", messages=[{"role": "user", "content": "hi"}]
            )
        error = info.value.response.json()["error"]
        assert error["code"] == "model_not_allowed"
        assert error["param"] == "model"
        assert "team-b" in error["message"]
        # /v1/models lists what the key may use.
        listed = {m.id for m in client(router, "sk-only-m2").models.list()}
        assert listed == {"m2"}


def test_bad_keys_file_names_file_and_field(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - {key: sk-1, modelz: [m1]}\n")
    config = tmp_path / "router.yaml"
    config.write_text(
        f"api_keys_file: {keys}\nendpoints: [{{id: e, url: 'http://127.0.0.1:1', models: [m]}}]\n"
    )
    done = subprocess.run(
        [str(Path(sys.executable).parent / "llmgw-router"), "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert f"{keys}: $.keys[0]: Object contains unknown field `modelz`" in done.stderr
    assert "Traceback" not in done.stderr
    config.write_text(
        "api_keys: [sk-1, sk-1]\nendpoints: [{id: e, url: 'http://127.0.0.1:1', models: [m]}]\n"
    )
    done = subprocess.run(
        [str(Path(sys.executable).parent / "llmgw-router"), "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert f"{config}: $.api_keys[1]: this API key is listed twice" in done.stderr


def test_no_usable_endpoint_is_503_with_retry_after(
    router: Router, upstreams: list[Upstream]
) -> None:
    e1, _ = upstreams
    e1.script(healthy=False)
    wait_for(
        lambda: router.endpoints()["endpoints"][0]["state"] == "unhealthy", what="e1 unhealthy"
    )
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "m2", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 503
    assert int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "no_usable_endpoint"
    assert [m["id"] for m in httpx.get(router.url + "/v1/models").json()["data"]] == ["m1"]
    e1.script(healthy=True)
    wait_for(lambda: router.endpoints()["endpoints"][0]["state"] == "ready", what="e1 ready again")
    assert (
        httpx.post(
            router.url + "/v1/chat/completions",
            json={"model": "m2", "messages": [{"role": "user", "content": "hi"}]},
        ).status_code
        == 200
    )


def test_retries_on_5xx_hangs_and_connect_errors(
    spawn_router: Spawn, upstreams: list[Upstream]
) -> None:
    e1, e2 = upstreams
    dead = free_port()
    cfg = {
        "endpoints": [
            e1.entry(["m1"]),
            e2.entry(["m1"]),
            {"id": "dead", "url": f"http://127.0.0.1:{dead}", "models": ["m1"]},
        ],
        # Random spreading, so that the dead endpoint is tried: cache_aware (the default)
        # would send these identical prompts to one endpoint.
        "balancer": "least_outstanding",
        "deadlines": {"first_byte": "1s"},
        "retries": {"max_retries": 3},
        "ejection": {"consecutive_failures": 2, "base_time": "30s"},
        "health_checks": {"enabled": False},
    }
    router = spawn_router(cfg)
    with router.proc:
        e1.script(status=500, count=1)
        e2.script(status=0, count=1)  # hangs past the first-byte deadline once
        url = router.url + "/v1/chat/completions"
        results = [
            httpx.post(
                url,
                json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]},
                timeout=30,
            )
            for _ in range(30)
        ]
        assert [r.status_code for r in results] == [200] * 30
        assert {r.headers["x-sim-name"] for r in results} <= {"e1", "e2"}
        states = {ep["id"]: ep for ep in router.endpoints()["endpoints"]}
        assert states["dead"]["state"] == "ejected"
        metrics = router.metrics()
        assert 'llmgw_router_upstream_errors_total{endpoint="dead",reason="connect"}' in metrics
        assert (
            'llmgw_router_upstream_errors_total{endpoint="e1",reason="status_5xx"} 1.0' in metrics
        )
        assert (
            'llmgw_router_upstream_errors_total{endpoint="e2",reason="timeout_first_byte"} 1.0'
            in metrics
        )
        assert 'llmgw_router_ejections_total{endpoint="dead"} 1.0' in metrics
        assert "llmgw_router_retries_total" in metrics


def test_5xx_passed_on_when_no_retry_is_left(
    spawn_router: Spawn, upstreams: list[Upstream]
) -> None:
    e1, _ = upstreams
    router = spawn_router({"endpoints": [e1.entry(["m1"])], "health_checks": {"enabled": False}})
    with router.proc:
        e1.script(status=503, count=5)
        r = httpx.post(
            router.url + "/v1/chat/completions",
            json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 503
        assert r.json()["error"]["message"] == "Scripted failure 503"
        # 429s are passed on too, but a busy endpoint is never ejected for them.
        e1.script(status=429, count=100)
        for _ in range(5):
            r = httpx.post(
                router.url + "/v1/chat/completions",
                json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]},
            )
            assert r.status_code == 429
        assert router.endpoints()["endpoints"][0]["state"] == "ready"


def test_client_disconnect_cancels_the_upstream_request(
    router: Router, upstreams: list[Upstream]
) -> None:
    for up in upstreams:
        up.script(itl=0.2)
    before = {up.id: up.stats() for up in upstreams}
    gone_before = metric(router.metrics(), 'llmgw_router_client_disconnects_total{model="m1"}')
    body = {
        "model": "m1",
        "stream": True,
        "max_tokens": 200,
        "messages": [{"role": "user", "content": "hi"}],
    }
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=30) as resp:
        served = next(up for up in upstreams if up.id == resp.headers["x-sim-name"])
        next(resp.iter_lines())
    # The client is gone after 1 of 200 chunks; the engine must hear of it long before the end.
    start = before[served.id]
    wait_for(
        lambda: served.stats()["cancelled"] == start["cancelled"] + 1,
        timeout=20,
        what="upstream request cancelled",
    )
    assert served.stats()["completed"] == start["completed"]
    series = 'llmgw_router_client_disconnects_total{model="m1"}'
    wait_for(lambda: metric(router.metrics(), series) == gone_before + 1, what="disconnect counted")


def test_sigterm_lets_streams_finish(spawn_router: Spawn, upstreams: list[Upstream]) -> None:
    e1, _ = upstreams
    router = spawn_router({"endpoints": [e1.entry(["m1"])], "shutdown_grace": "20s"})
    e1.script(itl=0.05)
    try:
        body = {
            "model": "m1",
            "stream": True,
            "max_tokens": 40,
            "messages": [{"role": "user", "content": "hi"}],
        }
        with httpx.stream(
            "POST", router.url + "/v1/chat/completions", json=body, timeout=30
        ) as resp:
            lines = resp.iter_lines()
            next(lines)
            router.proc.signal(signal.SIGTERM)
            wait_for(lambda: "shutting down" in router.proc.output(), what="shutdown logged")
            # New connections are refused while the stream in flight goes on.
            wait_for(lambda: not port_open(router.port), what="listener closed")
            assert router.proc.alive()
            events = sse_events("\n".join(lines))
        assert events[-1] == "[DONE]"
        assert not any("upstream_error" in e for e in events)
        assert router.proc.wait(timeout=20) == 0
        assert "router stopped" in router.proc.output()
    finally:
        router.proc.stop()
