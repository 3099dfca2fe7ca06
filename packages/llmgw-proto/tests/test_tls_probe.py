"""llmgw_proto.tls_probe: TLS or not, from a connection's first bytes and by asking."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from llmgw_proto.tls_probe import looks_like_http2, looks_like_tls, mismatch, speaks_tls


def test_first_bytes() -> None:
    assert looks_like_tls(b"\x16\x03\x01\x02\x00")
    assert looks_like_tls(b"\x15\x03\x03")
    assert not looks_like_tls(b"PRI * HTTP/2.0\r\n")
    assert not looks_like_tls(b"\x00\x00\x06\x04")
    assert looks_like_http2(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00")
    assert not looks_like_http2(b"\x16\x03\x01")


@given(st.binary(max_size=40))
def test_nothing_is_both(first: bytes) -> None:
    assert not (looks_like_tls(first) and looks_like_http2(first))


@given(st.booleans(), st.one_of(st.none(), st.booleans()))
def test_mismatch_only_when_they_disagree(client: bool, server: bool | None) -> None:
    words = mismatch("h:1", client, server)
    assert bool(words) == (server is not None and server != client)
    if words:
        assert words.startswith("TLS mismatch: ")
        assert "h:1" in words


async def test_speaks_tls_asks_a_real_server(tmp_path: Path) -> None:
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    await asyncio.to_thread(
        subprocess.run,
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "1", "-subj", "/CN=localhost"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)

    async def plain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.write(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")  # an HTTP/2 SETTINGS frame
        await writer.drain()
        writer.close()

    async def quiet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    tls_server = await asyncio.start_server(quiet, "127.0.0.1", 0, ssl=context)
    plain_server = await asyncio.start_server(plain, "127.0.0.1", 0)
    async with tls_server, plain_server:
        tls_port = tls_server.sockets[0].getsockname()[1]
        plain_port = plain_server.sockets[0].getsockname()[1]
        assert await speaks_tls("127.0.0.1", tls_port) is True
        assert await speaks_tls("127.0.0.1", plain_port) is False
    assert await speaks_tls("127.0.0.1", plain_port, timeout=2) is None  # closed now
