"""serving.py: the routes an engine's /openapi.json lists, and llama-server's."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st
from llmgw_agent import serving
from llmgw_proto import v1


def test_openapi_paths_become_routes() -> None:
    doc = {
        "openapi": "3.1.0",
        "paths": {
            "/v1/responses": {"post": {}},
            "/v1/responses/{response_id}": {"get": {}, "delete": {}},
            "/docs": {"get": {}},
            "/openapi.json": {"get": {}},
            "/odd": {"parameters": []},
            "relative": {"post": {}},
        },
    }
    assert serving.openapi_routes(json.dumps(doc).encode()) == [
        "/v1/responses",
        "/v1/responses/{response_id}",
    ]


@given(st.binary(max_size=400))
def test_any_body_gives_a_bounded_list(body: bytes) -> None:
    routes = serving.openapi_routes(body)
    assert len(routes) <= 512
    assert all(r.startswith("/") and len(r) <= 256 for r in routes)


@given(st.dictionaries(st.text(max_size=300), st.sampled_from(["get", "post", "head"])))
def test_paths_kept_are_api_paths(paths: dict[str, str]) -> None:
    body = json.dumps({"paths": {p: {m: {}} for p, m in paths.items()}}).encode()
    routes = serving.openapi_routes(body)
    assert routes == sorted(routes)
    for p in routes:
        assert p in paths
        assert paths[p] != "head"
        assert p not in ("/docs", "/redoc", "/openapi.json")


async def test_llama_server_routes_need_no_request() -> None:
    routes = await serving.read_routes(v1.EngineKind.LLAMACPP, "")
    assert "/v1/messages" in routes
    assert "/v1/responses" not in routes


async def test_unreachable_engine_has_no_known_routes() -> None:
    assert await serving.read_routes(v1.EngineKind.VLLM, "http://127.0.0.1:1/health") == []
    assert await serving.read_routes(v1.EngineKind.VLLM, "not a url") == []


def test_stamp_adds_routes_at_ready_only() -> None:
    serving.remember_routes("s1", ["/v1/rerank"])
    try:
        ready = serving.stamp(v1.ShardStatus(shard_id="s1", state=v1.ShardState.READY))
        starting = serving.stamp(v1.ShardStatus(shard_id="s1", state=v1.ShardState.STARTING))
        assert ready.routes == ["/v1/rerank"]
        assert starting.routes == []
        assert ready.traceparent == ""  # tracing off
    finally:
        serving.forget("s1")
    assert serving.routes_of("s1") == []
