"""A tiny HTTP GET for engine health checks and metrics, on asyncio streams.

(Metrics text is read by :func:`llmgw_agent.load.metric_values`, the one parser.)

The agent wheel stays free of HTTP client libraries: a GPU node installs as
little as possible. The request is HTTP/1.0 so no server answers with chunked
encoding; a chunked reply is decoded anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from urllib.parse import urlsplit

__all__ = ["http_get", "http_post"]

_MAX_BODY = 16 * 1024 * 1024


async def http_get(url: str, *, timeout: float = 5.0, api_key: str = "") -> tuple[int, bytes]:
    """(status, body) of GET ``url``; raises OSError or TimeoutError when it cannot.

    ``api_key``: the engine's secret, sent as ``Authorization: Bearer`` (llama-server
    guards /metrics with it; the other engines ignore it where they do not ask).
    """
    async with asyncio.timeout(timeout):
        return await _get(url, api_key)


async def http_post(
    url: str, body: bytes, *, timeout: float = 5.0, api_key: str = ""
) -> tuple[int, bytes]:
    """(status, body) of POST ``url`` with a JSON ``body`` (the engines' LoRA APIs)."""
    async with asyncio.timeout(timeout):
        return await _get(url, api_key, method="POST", body=body)


async def _get(
    url: str, api_key: str, *, method: str = "GET", body: bytes = b""
) -> tuple[int, bytes]:
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or 80
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    reader, writer = await asyncio.open_connection(host, port)
    try:
        host_header = f"[{host}]" if ":" in host else host
        auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        sent = (
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            if method != "GET"
            else ""
        )
        writer.write(
            f"{method} {path} HTTP/1.0\r\nHost: {host_header}:{port}\r\n{auth}{sent}"
            "User-Agent: llmgw-agent\r\nAccept: */*\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        raw = await reader.read(_MAX_BODY)
        while len(raw) < _MAX_BODY:
            more = await reader.read(_MAX_BODY - len(raw))
            if not more:
                break
            raw += more
    finally:
        writer.close()
        with contextlib.suppress(OSError, asyncio.CancelledError):
            await writer.wait_closed()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    match = re.match(rb"HTTP/\d(?:\.\d)? (\d{3})", lines[0] if lines else b"")
    if not match:
        raise OSError(f"not an HTTP response from {url}")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines[1:])}
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        body = _dechunk(body)
    return int(match.group(1)), body


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            break
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2 :]
    return bytes(out)
