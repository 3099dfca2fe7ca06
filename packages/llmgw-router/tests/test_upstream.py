"""The request-path HTTP client against a real aiohttp server on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from llmgw_router.upstream import ConnectError, Pool, ResetError
from llmgw_testkit import free_port


@pytest.fixture
async def engine() -> AsyncIterator[tuple[str, list[int]]]:
    """A server that records the client port of every request (one port: one connection)."""
    peers: list[int] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        body = await request.read()
        if request.path == "/close":
            return web.Response(body=body, headers={"connection": "close"})
        if request.path == "/stream":
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(3):
                await resp.write(b"data: %d\n\n" % i)
                await asyncio.sleep(0.01)
            await resp.write_eof()
            return resp
        if request.path == "/cut":
            resp = web.StreamResponse()
            resp.content_length = 100
            await resp.prepare(request)
            await resp.write(b"partial")
            request.transport.close()  # type: ignore[union-attr]
            return resp
        return web.Response(body=body, status=201, headers={"x-seen": "yes"})

    app = web.Application()
    app.router.add_route("POST", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", peers
    finally:
        await runner.cleanup()


async def test_keep_alive_reuse_and_streaming(engine: tuple[str, list[int]]) -> None:
    url, peers = engine
    pool = Pool()
    for _ in range(3):
        resp = await pool.post(url, "/echo", b"hello", [(b"x-a", b"1")], connect_timeout=2)
        assert resp.status == 201
        assert (b"x-seen", b"yes") in resp.headers
        assert await resp.read() == b"hello"
        resp.release()
    assert len(set(peers)) == 1, "one kept-alive connection served all three"

    resp = await pool.post(url, "/stream", b"", [], connect_timeout=2)
    chunks = []
    while chunk := await resp.read_chunk():
        chunks.append(chunk)
    assert b"".join(chunks) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    resp.release()
    pool.close()


async def test_closed_connections_are_not_reused(engine: tuple[str, list[int]]) -> None:
    url, peers = engine
    pool = Pool()
    for _ in range(2):
        resp = await pool.post(url, "/close", b"x", [], connect_timeout=2)
        assert await resp.read() == b"x"
        resp.release()
    assert len(set(peers)) == 2


async def test_errors(engine: tuple[str, list[int]]) -> None:
    url, _ = engine
    pool = Pool()
    resp = await pool.post(url, "/cut", b"", [], connect_timeout=2)
    with pytest.raises(ResetError, match="closed by the engine"):
        await resp.read()
    resp.close()
    with pytest.raises(ConnectError, match="cannot connect"):
        await pool.post(f"http://127.0.0.1:{free_port()}", "/", b"", [], connect_timeout=2)
