"""A client that closes on `data: [DONE]` before the upstream's end still has its usage counted.

The OpenAI client stops reading a stream at `[DONE]` and closes it; the router may see that
before the upstream's end of stream. The engine did the work either way, so the tokens the
stream's usage chunk reports are counted whichever comes first.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from llmgw_testkit import free_port, wait_for
from llmgw_testkit.checks import metric

Spawn = Callable[..., Any]

USAGE = (
    b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m1",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":"hi"},"finish_reason":null}]}\n\n'
    b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m1","choices":[],'
    b'"usage":{"prompt_tokens":7,"completion_tokens":5,"total_tokens":12}}\n\n'
    b"data: [DONE]\n\n"
)


def _read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        got = conn.recv(65536)
        if not got:
            return data
        data += got
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        got = conn.recv(65536)
        if not got:
            break
        body += got
    return head


@pytest.fixture
def holding_upstream() -> Iterator[str]:
    """An engine that sends a whole stream, [DONE] included, and then never ends it."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", free_port()))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            head = _read_request(conn)
            if head.startswith(b"POST"):
                chunk = b"%x\r\n%s\r\n" % (len(USAGE), USAGE)
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n" + chunk
                )
                held.append(conn)  # no last chunk: the stream stays open
            else:
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        server.close()
        for conn in held:
            conn.close()
        thread.join(timeout=5)


def test_usage_is_counted_when_the_client_leaves_at_done(
    spawn_router: Spawn, holding_upstream: str
) -> None:
    router = spawn_router(
        {
            "endpoints": [{"id": "held", "url": holding_upstream, "models": ["m1"]}],
            "health_checks": {"enabled": False},
        }
    )
    host, port = router.url.removeprefix("http://").split(":")
    body = b'{"model":"m1","stream":true,"messages":[{"role":"user","content":"hi"}]}'
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        seen = b""
        while b"data: [DONE]" not in seen:
            got = conn.recv(65536)
            assert got, f"the router closed before [DONE]: {seen!r}"
            seen += got
    # The client is gone; the upstream never ended its stream.
    series = 'llmgw_router_tokens_total{kind="completion",model="m1"}'
    wait_for(
        lambda: metric(router.metrics(), series) == 5,
        timeout=30,
        what="the stream's 5 completion tokens counted after the client left",
    )
    prompt = 'llmgw_router_tokens_total{kind="prompt",model="m1"}'
    assert metric(router.metrics(), prompt) == 7
