"""Whether a server speaks TLS: how a client names a TLS mismatch instead of a reset.

A plaintext gRPC client reaching a TLS server (or the other way round) sees only a
connection that ends; so does the server. When a connection fails before its stream
ever came up, the client asks :func:`speaks_tls` and, when the answer contradicts its
own setting, says so in words (:func:`mismatch`). The server side recognises the
other's first bytes (:func:`looks_like_tls`, :func:`looks_like_http2`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl

__all__ = ["looks_like_http2", "looks_like_tls", "mismatch", "speaks_tls"]

# A TLS record: handshake (22) or alert (21), then major version 3.
_TLS_TYPES = (0x15, 0x16)


def looks_like_tls(first: bytes) -> bool:
    """Whether ``first`` (a connection's first bytes) starts a TLS record."""
    return len(first) >= 2 and first[0] in _TLS_TYPES and first[1] == 0x03


def looks_like_http2(first: bytes) -> bool:
    """Whether ``first`` is (the start of) HTTP/2's plaintext client preface."""
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    n = min(len(first), len(preface))
    return n >= 4 and first[:n] == preface[:n]


def _client_hello() -> bytes:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_side=False)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


async def speaks_tls(host: str, port: int, timeout: float = 3.0) -> bool | None:
    """True when ``host:port`` answers a TLS ClientHello in TLS, False when with anything
    else (or by closing), None when it cannot be reached or says nothing in time."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, TimeoutError):
        return None
    try:
        writer.write(_client_hello())
        await writer.drain()
        first = await asyncio.wait_for(reader.read(5), timeout)
    except TimeoutError:
        return None
    except OSError:
        return False
    finally:
        writer.close()
        with contextlib.suppress(OSError, TimeoutError):
            await asyncio.wait_for(writer.wait_closed(), timeout)
    return looks_like_tls(first)


def mismatch(address: str, client_tls: bool, server_tls: bool | None) -> str:
    """The words for a TLS mismatch between this client and the server at ``address``;
    "" when there is none (or the server's side is unknown)."""
    if server_tls is None or server_tls == client_tls:
        return ""
    if server_tls:
        return (
            f"TLS mismatch: the control plane at {address} serves TLS and this side connects "
            "in plaintext (tls.insecure or --insecure): give it tls cert, key and ca, or run "
            "both in plaintext"
        )
    return (
        f"TLS mismatch: this side connects with TLS and the control plane at {address} serves "
        "plaintext (tls.insecure or --insecure there): give the control plane tls cert, key "
        "and ca, or run both in plaintext"
    )
