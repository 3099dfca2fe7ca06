"""Issue 24.3: the router sends each engine its secret and never the client's key."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from llmgw_proto import v1
from llmgw_router.control.watch import spec_from_wire
from llmgw_router.endpoints import EndpointSpec
from llmgw_router.upstream import Pool
from llmgw_testkit import free_port


@pytest.fixture
async def engine() -> AsyncIterator[tuple[str, list[str | None]]]:
    """A server that records the Authorization header of every request (None: none)."""
    seen: list[str | None] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.Response(body=await request.read())

    app = web.Application()
    app.router.add_route("POST", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


async def test_engine_secret_replaces_the_clients_authorization(
    engine: tuple[str, list[str | None]],
) -> None:
    url, seen = engine
    pool = Pool()
    client_headers = [(b"content-type", b"application/json"), (b"authorization", b"Bearer sk-c")]
    for key in ("engine-secret", ""):
        resp = await pool.post(url, "/v1/x", b"{}", client_headers, connect_timeout=2, api_key=key)
        assert await resp.read() == b"{}"
        resp.release()
    pool.close()
    # The engine's own key, then (an engine without one) nothing: never the client's.
    assert seen == ["Bearer engine-secret", None]


def test_the_secret_comes_from_the_published_endpoint() -> None:
    wire = v1.Endpoint(id="r1", url="http://10.0.0.5:20001/", model="m", api_key="s3cr3t")
    spec = spec_from_wire(wire)
    assert spec.api_key == "s3cr3t"
    assert "s3cr3t" not in repr(spec)  # never in logs


@given(st.text(max_size=40))
def test_a_secret_that_cannot_be_a_header_value_is_dropped(key: str) -> None:
    spec = spec_from_wire(v1.Endpoint(id="r1", url="http://h:1", model="m", api_key=key))
    assert spec.api_key in (key, "")
    assert "\r" not in spec.api_key
    assert "\n" not in spec.api_key
    assert all(0x21 <= ord(c) <= 0x7E for c in spec.api_key)


def test_static_endpoints_have_no_secret() -> None:
    assert EndpointSpec(id="e", url="http://h:1", models=("m",)).api_key == ""
