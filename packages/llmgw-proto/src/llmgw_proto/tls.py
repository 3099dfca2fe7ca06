"""TLS contexts for the agent and publish streams (gRPC over HTTP/2, mutual TLS).

Both sides verify the other against the llmgw CA; the server requires a client
certificate. ALPN offers only ``h2``, as gRPC requires.
"""

from __future__ import annotations

import ssl
from pathlib import Path

__all__ = ["client_context", "peer_common_name", "server_context"]


def server_context(
    cert: Path, key: Path, ca: Path, *, require_client_cert: bool = True
) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(ca))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(cert), str(key))
    ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
    ctx.set_alpn_protocols(["h2"])
    return ctx


def client_context(cert: Path, key: Path, ca: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(cert), str(key))
    ctx.set_alpn_protocols(["h2"])
    return ctx


def peer_common_name(peer_cert: dict[str, object] | None) -> str | None:
    """The subject common name of a certificate as ``SSLSocket.getpeercert()`` gives it."""
    if not peer_cert:
        return None
    subject = peer_cert.get("subject", ())
    for rdn in subject:  # type: ignore[attr-defined]
        for attr, value in rdn:
            if attr == "commonName":
                return str(value)
    return None
