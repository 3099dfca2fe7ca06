"""The CA and the TLS contexts, over real TLS handshakes on loopback."""

from __future__ import annotations

import asyncio
import datetime
import ssl
import stat
from pathlib import Path

import pytest
from llmgw_control.ca import CaError, init_ca, issue
from llmgw_proto.tls import (
    CertReloader,
    PeerIdentity,
    client_context,
    peer_identity,
    server_context,
)


@pytest.fixture
def ca_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "ca"
    init_ca(directory)
    return directory


def test_ca_key_is_owner_only_and_init_refuses_to_overwrite(ca_dir: Path) -> None:
    assert stat.S_IMODE((ca_dir / "ca.key").stat().st_mode) == 0o600
    with pytest.raises(CaError, match="already holds a CA"):
        init_ca(ca_dir)


def test_issue_needs_a_ca_and_a_known_role(tmp_path: Path, ca_dir: Path) -> None:
    with pytest.raises(CaError, match="run `llmgw-control ca init"):
        issue(tmp_path / "none", "node", "gpu-a")
    with pytest.raises(CaError, match="unknown role 'operator'"):
        issue(ca_dir, "operator", "x")
    with pytest.raises(CaError, match="invalid name"):
        issue(ca_dir, "node", "../etc")
    node = issue(ca_dir, "node", "gpu-a")
    assert node.cert.name == "node-gpu-a.crt"
    # An operator's certificate for admin changes (issue 29).
    assert issue(ca_dir, "admin", "alice").cert.name == "admin-alice.crt"
    assert stat.S_IMODE(node.key.stat().st_mode) == 0o600


async def handshake(server: ssl.SSLContext, client: ssl.SSLContext) -> PeerIdentity | None:
    """One TLS connection on loopback; returns who the server saw, or raises."""
    seen: asyncio.Future[PeerIdentity | None] = asyncio.get_running_loop().create_future()

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ssl_obj = writer.get_extra_info("ssl_object")
        if not seen.done():
            seen.set_result(peer_identity(ssl_obj.getpeercert()))
        writer.write(b"ok")
        await writer.drain()
        writer.close()

    srv = await asyncio.start_server(on_client, "127.0.0.1", 0, ssl=server)
    port = srv.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client, server_hostname="localhost"
        )
        # Under TLS 1.3 the server judges the client certificate after the client's side
        # of the handshake is done: a refusal shows as a closed connection.
        if await reader.read(2) != b"ok":
            raise ConnectionError("server closed the connection")
        assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == "h2"
        writer.close()
        return await asyncio.wait_for(seen, 5)
    finally:
        srv.close()
        await srv.wait_closed()


@pytest.fixture
def server_ctx(ca_dir: Path) -> ssl.SSLContext:
    srv = issue(ca_dir, "server", "localhost", hosts=["localhost", "127.0.0.1"])
    return server_context(srv.cert, srv.key, ca_dir / "ca.crt")


async def test_node_certificate_is_accepted_and_named(
    ca_dir: Path, server_ctx: ssl.SSLContext
) -> None:
    node = issue(ca_dir, "node", "gpu-a")
    seen = await handshake(server_ctx, client_context(node.cert, node.key, ca_dir / "ca.crt"))
    assert seen == PeerIdentity(role="node", name="gpu-a")
    router = issue(ca_dir, "router", "edge-1")
    seen = await handshake(server_ctx, client_context(router.cert, router.key, ca_dir / "ca.crt"))
    assert seen == PeerIdentity(role="router", name="edge-1")


async def test_other_ca_expired_and_missing_certificates_are_refused(
    tmp_path: Path, ca_dir: Path, server_ctx: ssl.SSLContext
) -> None:
    other = tmp_path / "other"
    init_ca(other)
    stranger = issue(other, "node", "gpu-a")
    with pytest.raises((ssl.SSLError, ConnectionError)):
        await handshake(server_ctx, client_context(stranger.cert, stranger.key, ca_dir / "ca.crt"))

    past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=2)
    expired = issue(
        ca_dir, "node", "old", not_before=past, not_after=past + datetime.timedelta(days=1)
    )
    with pytest.raises((ssl.SSLError, ConnectionError)):
        await handshake(server_ctx, client_context(expired.cert, expired.key, ca_dir / "ca.crt"))

    bare = ssl.create_default_context(cafile=str(ca_dir / "ca.crt"))
    bare.set_alpn_protocols(["h2"])
    with pytest.raises((ssl.SSLError, ConnectionError)):
        await handshake(server_ctx, bare)


async def test_rotated_server_certificate_is_picked_up(ca_dir: Path, tmp_path: Path) -> None:
    first = issue(ca_dir, "server", "localhost", hosts=["localhost"], out=tmp_path / "live")
    ctx = server_context(first.cert, first.key, ca_dir / "ca.crt")
    reloader = CertReloader(ctx, first.cert, first.key, ca_dir / "ca.crt")
    assert reloader.check() is False

    node = issue(ca_dir, "node", "gpu-a")
    client = client_context(node.cert, node.key, ca_dir / "ca.crt")
    seen_serials: list[int] = []

    async def serial() -> int:
        _, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client, server_hostname="localhost"
        )
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.close()
        from cryptography import x509

        return x509.load_der_x509_certificate(der).serial_number

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.close()

    srv = await asyncio.start_server(on_client, "127.0.0.1", 0, ssl=ctx)
    port = srv.sockets[0].getsockname()[1]
    try:
        seen_serials.append(await serial())
        # Rotate in place (a new key pair at the same paths), as an operator would.
        issue(ca_dir, "server", "localhost", hosts=["localhost"], out=tmp_path / "live")
        assert reloader.check() is True
        seen_serials.append(await serial())
    finally:
        srv.close()
        await srv.wait_closed()
    assert reloader.reloads == 1
    assert seen_serials[0] != seen_serials[1]
