"""Refusals answered by the front protocol itself are counted (issue 24).

A slow head or body (408), a long request line (414), oversized headers (431) and a
request the parser cannot read (400) are answered before any route or model is known;
they must still reach ``llmgw_router_requests_total`` (``model=""``, ``endpoint=""``,
the router's labels for a request answered before it knew a model), or a dashboard
never sees them. Real router process, raw sockets.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable
from typing import Any

from llmgw_testkit import free_port, wait_for

Router = Any
Spawn = Callable[..., Any]


def _counts(text: str) -> dict[str, float]:
    """status -> value of llmgw_router_requests_total{model="",endpoint=""}."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        match = re.fullmatch(
            r'llmgw_router_requests_total\{endpoint="",model="",status="(\d+)"\} (\S+)', line
        )
        if match:
            found[match[1]] = float(match[2])
    return found


def _answer(router: Router, data: bytes) -> bytes:
    """Send ``data`` and read until the router closes: its whole answer."""
    with socket.create_connection(("127.0.0.1", router.port), timeout=30) as sock:
        sock.sendall(data)
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
        return got


def test_408_414_431_and_400_are_counted(spawn_router: Spawn) -> None:
    router = spawn_router(
        {
            "endpoints": [{"id": "e1", "url": f"http://127.0.0.1:{free_port()}", "models": ["m1"]}],
            "health_checks": {"enabled": False},
            "http": {"max_head_bytes": 1024, "head_timeout": "1s", "body_timeout": "1s"},
        }
    )
    assert _answer(router, b"GET /v1/models?q=" + b"u" * 4096 + b" HTTP/1.1\r\n").startswith(
        b"HTTP/1.1 414 "
    )
    big_header = b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 4096 + b"\r\n\r\n"
    assert _answer(router, big_header).startswith(b"HTTP/1.1 431 ")
    assert _answer(router, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n").startswith(
        b"HTTP/1.1 408 "
    )
    half_body = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{"
    assert _answer(router, half_body).startswith(b"HTTP/1.1 408 ")
    assert _answer(router, b"NOT HTTP AT ALL\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    # A connection closed without a request begun is no request: not counted.
    assert _answer(router, b"") == b""

    want = {"400": 1.0, "408": 2.0, "414": 1.0, "431": 1.0}
    wait_for(
        lambda: all(_counts(router.metrics()).get(k) == v for k, v in want.items()),
        timeout=60,
        what=f"requests_total to count {want}",
    )
