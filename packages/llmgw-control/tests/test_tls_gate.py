"""The TLS gate in front of the gRPC server: verified peers reach grpclib, and every
refused handshake is reported with the peer's address and the reason."""

from __future__ import annotations

import asyncio
import datetime
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from grpclib.client import Channel
from llmgw_control.ca import init_ca, issue
from llmgw_control.publish import Publisher
from llmgw_control.tls_gate import GatedServer
from llmgw_proto import v1
from llmgw_proto.tls import client_context, server_context
from llmgw_testkit import free_port, wait_for_async


@pytest.fixture
def ca_dir(tmp_path: Path) -> Path:
    init_ca(tmp_path / "ca")
    return tmp_path / "ca"


@pytest.fixture
async def gated(ca_dir: Path) -> AsyncIterator[tuple[int, list[tuple[str, str]]]]:
    srv = issue(ca_dir, "server", "localhost", hosts=["localhost", "127.0.0.1"])
    refused: list[tuple[str, str]] = []
    publisher = Publisher()
    publisher.primed.set()  # no startup grace to wait for here
    server = GatedServer(
        [publisher],
        ssl_context=server_context(srv.cert, srv.key, ca_dir / "ca.crt"),
        on_refused=lambda peer, why: refused.append((peer, why)),
    )
    port = free_port()
    await server.start_gated("127.0.0.1", port)
    try:
        yield port, refused
    finally:
        server.close()
        await server.wait_closed()


async def first_snapshot(port: int, ctx: ssl.SSLContext) -> v1.EndpointSnapshot:
    channel = Channel("127.0.0.1", port, ssl=ctx)
    try:
        stub = v1.EndpointServiceStub(channel)
        async for snapshot in stub.watch(v1.WatchRequest(router_id="t"), timeout=10):
            return snapshot
        raise AssertionError("no snapshot")
    finally:
        channel.close()


async def test_verified_peer_reaches_the_grpc_service(
    ca_dir: Path, gated: tuple[int, list[tuple[str, str]]]
) -> None:
    port, refused = gated
    router = issue(ca_dir, "router", "edge")
    snapshot = await first_snapshot(
        port, client_context(router.cert, router.key, ca_dir / "ca.crt")
    )
    assert snapshot.version > 0
    assert snapshot.endpoints == []
    assert refused == []


async def test_refused_handshakes_are_reported(
    tmp_path: Path, ca_dir: Path, gated: tuple[int, list[tuple[str, str]]]
) -> None:
    port, refused = gated
    init_ca(tmp_path / "other")
    stranger = issue(tmp_path / "other", "node", "gpu-a")
    past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=3)
    expired = issue(
        ca_dir, "node", "old", not_before=past, not_after=past + datetime.timedelta(days=1)
    )
    bare = ssl.create_default_context(cafile=str(ca_dir / "ca.crt"))
    bare.set_alpn_protocols(["h2"])
    contexts = [
        client_context(stranger.cert, stranger.key, ca_dir / "ca.crt"),
        client_context(expired.cert, expired.key, ca_dir / "ca.crt"),
        bare,
    ]
    for ctx in contexts:
        with pytest.raises((ConnectionError, OSError, asyncio.TimeoutError, Exception)):
            await asyncio.wait_for(first_snapshot(port, ctx), 10)

    async def three() -> bool:
        return len(refused) >= 3

    await wait_for_async(three, timeout=10, what="three refusals reported")
    reasons = [why for _, why in refused]
    assert all(peer.startswith("127.0.0.1:") for peer, _ in refused)
    assert (
        "unable to get local issuer certificate" in reasons[0] or "unknown ca" in reasons[0].lower()
    )
    assert "expired" in reasons[1]
    assert "certificate" in reasons[2].lower()
