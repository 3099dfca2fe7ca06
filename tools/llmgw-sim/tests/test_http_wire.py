"""The simulator's HTTP/1.1 handling on the wire, with raw sockets against a real process."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest
from llmgw_sim.testing import Sim, start

BODY = json.dumps(
    {"model": "org/model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
).encode()


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    with start(tmp_path_factory.mktemp("wire"), "vllm") as s:
        yield s


def connect(sim: Sim) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", sim.port), timeout=10)
    return sock


def read_response(sock: socket.socket, buf: bytearray) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response (Content-Length or chunked) from ``sock``; leftovers stay in buf."""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        assert data, "connection closed before the response head"
        buf += data
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    buf[:] = rest
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        body = bytearray()
        while True:
            while b"\r\n" not in buf:
                buf += sock.recv(65536)
            size_line, _, _ = bytes(buf).partition(b"\r\n")
            size = int(size_line, 16)
            while len(buf) < len(size_line) + 2 + size + 2:
                buf += sock.recv(65536)
            start = len(size_line) + 2
            body += buf[start : start + size]
            del buf[: start + size + 2]
            if size == 0:
                return status, headers, bytes(body)
    length = int(headers.get("content-length", "0"))
    while len(buf) < length:
        buf += sock.recv(65536)
    content = bytes(buf[:length])
    del buf[:length]
    return status, headers, content


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


def test_pipelined_keep_alive_requests(sim: Sim) -> None:
    with connect(sim) as sock:
        sock.sendall(
            post("/v1/chat/completions", BODY) * 3 + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        buf = bytearray()
        for _ in range(3):
            status, headers, body = read_response(sock, buf)
            assert status == 200
            assert headers["server"] == "uvicorn"
            assert json.loads(body)["usage"]["completion_tokens"] == 2
        status, _, body = read_response(sock, buf)
        assert (status, body) == (200, b"")


def test_chunked_request_body(sim: Sim) -> None:
    chunks = [BODY[:10], BODY[10:]]
    payload = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Transfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n"
    )
    with connect(sim) as sock:
        sock.sendall(head + payload)
        status, _, body = read_response(sock, bytearray())
    assert status == 200
    assert json.loads(body)["object"] == "chat.completion"


def test_expect_100_continue(sim: Sim) -> None:
    head = post("/v1/chat/completions", b"", "Expect: 100-continue\r\n").replace(
        b"Content-Length: 0", b"Content-Length: %d" % len(BODY)
    )
    with connect(sim) as sock:
        sock.sendall(head)
        interim = sock.recv(1024)
        assert interim.startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(BODY)
        buf = bytearray(interim[len(b"HTTP/1.1 100 Continue\r\n\r\n") :])
        status, _, _ = read_response(sock, buf)
    assert status == 200


def test_head_request_has_no_body(sim: Sim) -> None:
    with connect(sim) as sock:
        sock.sendall(b"HEAD /version HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\n\r\n")
        buf = bytearray()
        while b"\r\n\r\n" not in buf:
            buf += sock.recv(65536)
        head, _, rest = bytes(buf).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK")
        assert b"content-length: 20" in head
        # The next response follows at once: no body bytes in between.
        buf[:] = rest
        assert read_response(sock, buf)[0] == 200


def test_http_10_closes_after_response(sim: Sim) -> None:
    with connect(sim) as sock:
        sock.sendall(b"GET /version HTTP/1.0\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200 OK")
    assert b"connection: close" in data.lower()
    assert data.endswith(b'{"version":"0.32.0"}')


def test_unknown_path_method_and_garbage(sim: Sim) -> None:
    with connect(sim) as sock:
        buf = bytearray()
        sock.sendall(b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock, buf)[0] == 404
        sock.sendall(b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock, buf)[0] == 405
    with connect(sim) as sock:
        sock.sendall(b"NONSENSE\r\n\r\n")
        status, headers, _ = read_response(sock, bytearray())
        assert status == 400
        assert headers["connection"] == "close"


def test_streamed_response_is_chunked_sse(sim: Sim) -> None:
    body = json.loads(BODY)
    body["stream"] = True
    with connect(sim) as sock:
        sock.sendall(post("/v1/chat/completions", json.dumps(body).encode()))
        status, headers, payload = read_response(sock, bytearray())
    assert status == 200
    assert headers["content-type"] == "text/event-stream; charset=utf-8"
    assert payload.endswith(b"data: [DONE]\n\n")
