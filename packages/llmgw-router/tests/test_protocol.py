"""The router's own HTTP/1.1 server (protocol.py) on raw sockets: what clients rely on.

Pipelining, keep-alive after an error, HTTP/1.0 and `connection: close`,
`Expect: 100-continue` with a chunked request body, query strings: each against the
real router process and simulated engines (llmgw-sim).
"""

from __future__ import annotations

import json
import socket
from typing import Any

import httptools

Router = Any

CHAT = b'{"model":"m1","messages":[{"role":"user","content":"hi"}],"max_tokens":3}'


def post(path: bytes, body: bytes, *extra: bytes, version: bytes = b"1.1") -> bytes:
    head = [
        b"POST " + path + b" HTTP/" + version,
        b"host: x",
        b"content-type: application/json",
        b"content-length: %d" % len(body),
        *extra,
    ]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


class _Responses:
    """Complete responses parsed off one connection, in order."""

    def __init__(self) -> None:
        self.done: list[tuple[int, dict[bytes, bytes], bytes]] = []
        self._headers: dict[bytes, bytes] = {}
        self._body = bytearray()
        self.parser = httptools.HttpResponseParser(self)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        self.done.append((self.parser.get_status_code(), self._headers, bytes(self._body)))
        self._headers, self._body = {}, bytearray()


def read_responses(sock: socket.socket, count: int) -> tuple[list[Any], bool]:
    """``count`` responses (fewer if the connection ends first); and whether it ended."""
    responses = _Responses()
    closed = False
    while len(responses.done) < count:
        data = sock.recv(65536)
        if not data:
            closed = True
            break
        responses.parser.feed_data(data)
    return responses.done, closed


def connect(router: Router) -> socket.socket:
    return socket.create_connection(("127.0.0.1", router.port), timeout=20)


def test_pipelined_requests_are_answered_in_order(router: Router) -> None:
    with connect(router) as sock:
        sock.sendall(
            post(b"/v1/chat/completions", CHAT)
            + b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n"
            + post(b"/v1/nowhere", b"{}")
            + post(b"/v1/completions", b'{"model":"m1","prompt":"x","max_tokens":2}')
        )
        answers, _ = read_responses(sock, 4)
    assert [status for status, _, _ in answers] == [200, 200, 404, 200]
    assert json.loads(answers[0][2])["object"] == "chat.completion"
    assert "m1" in {m["id"] for m in json.loads(answers[1][2])["data"]}
    assert json.loads(answers[2][2])["error"]["code"] == "not_found"
    assert json.loads(answers[3][2])["object"] == "text_completion"


def test_a_413_keeps_the_connection_for_the_next_request(router: Router) -> None:
    big = b'{"model":"m1","pad":"' + b"x" * 1_500_000 + b'"}'
    with connect(router) as sock:
        sock.sendall(post(b"/v1/chat/completions", big))
        ((status, _, body),) = read_responses(sock, 1)[0]
        assert status == 413
        assert json.loads(body)["error"]["code"] == "request_too_large"
        sock.sendall(post(b"/v1/chat/completions?trace=1", CHAT))
        ((status, _, body),) = read_responses(sock, 1)[0]
    assert status == 200, body
    assert json.loads(body)["choices"]


def test_http_1_0_and_connection_close_end_the_connection(router: Router) -> None:
    for request in (
        post(b"/v1/chat/completions", CHAT, version=b"1.0"),
        post(b"/v1/chat/completions", CHAT, b"connection: close"),
    ):
        with connect(router) as sock:
            sock.sendall(request)
            answers, _ = read_responses(sock, 1)
            assert answers[0][0] == 200
            assert answers[0][1][b"connection"].lower() == b"close"
            assert sock.recv(100) == b""


def test_expect_100_continue_with_a_chunked_body(router: Router) -> None:
    with connect(router) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\nexpect: 100-continue\r\n\r\n"
        )
        assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        half = len(CHAT) // 2
        for part in (CHAT[:half], CHAT[half:]):
            sock.sendall(b"%x\r\n%b\r\n" % (len(part), part))
        sock.sendall(b"0\r\n\r\n")
        ((status, _, body),) = read_responses(sock, 1)[0]
    assert status == 200, body
    assert json.loads(body)["object"] == "chat.completion"


def test_a_stream_is_sent_chunked_and_the_connection_is_reused(
    router: Router, upstreams: list[Any]
) -> None:
    for up in upstreams:
        up.script(itl=0.02)
    stream = (
        b'{"model":"m1","stream":true,"max_tokens":5,"messages":[{"role":"user","content":"hi"}]}'
    )
    with connect(router) as sock:
        for _ in range(2):
            sock.sendall(post(b"/v1/chat/completions", stream))
            ((status, headers, body),) = read_responses(sock, 1)[0]
            assert status == 200
            assert headers[b"transfer-encoding"] == b"chunked"
            assert body.rstrip().endswith(b"data: [DONE]")


def test_head_gets_the_head_only_and_keeps_the_connection(router: Router) -> None:
    with connect(router) as sock:
        sock.sendall(b"HEAD /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            head += sock.recv(1)
        assert head.startswith(b"HTTP/1.1 405 ")
        # No body followed the head: the next answer starts right after it.
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        ((status, _, body),) = read_responses(sock, 1)[0]
    assert status == 200
    assert json.loads(body)["object"] == "list"
