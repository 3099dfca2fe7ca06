"""Issue 24.5: the router judges a request on its head, and bounds what it reads.

Against a real router process on raw sockets: a huge header is answered 431 before
the client has sent it (and the rest is not read), a huge URL 414, a half-sent head
or body 408 and closed, a wrong key 401 without `100 Continue` and before the body,
and connections past `http.max_connections` 503. The settings' validation and the
pure helpers are tested on their own.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httptools
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from llmgw_proto.config import ConfigError, Duration, load
from llmgw_router.config import HttpConfig, RouterConfig, validate
from llmgw_router.front.protocol import head_room, sweep_interval
from llmgw_testkit import free_port, wait_for

Router = Any
Spawn = Callable[..., Any]

CHAT = b'{"model":"m1","messages":[{"role":"user","content":"hi"}],"max_tokens":3}'


def config(**http: Any) -> dict[str, Any]:
    # The endpoint need not answer: these requests are judged before any is picked.
    return {
        "endpoints": [{"id": "e1", "url": f"http://127.0.0.1:{free_port()}", "models": ["m1"]}],
        "health_checks": {"enabled": False},
        "http": http,
    }


def connect(router: Router) -> socket.socket:
    return socket.create_connection(("127.0.0.1", router.port), timeout=30)


class _Response:
    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.body = bytearray()
        self.done = False
        self.parser = httptools.HttpResponseParser(self)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.done = True


def read_response(sock: socket.socket) -> tuple[int, dict[bytes, bytes], dict[str, Any], bytes]:
    """One response (status, headers, error object) and the first bytes seen."""
    response = _Response()
    first = b""
    while not response.done:
        data = sock.recv(65536)
        assert data, "the connection closed without an answer"
        first = first or data
        response.parser.feed_data(data)
    return response.status, response.headers, json.loads(response.body)["error"], first


def ends(sock: socket.socket) -> bool:
    """The router closed the connection: EOF or a reset, within the socket's timeout."""
    try:
        while True:
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True


def test_an_8_mib_header_is_431_before_the_client_has_sent_it(spawn_router: Spawn) -> None:
    router = spawn_router(config())
    big = 8 * 1024 * 1024
    with connect(router) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-big: ")
        sent = 0
        # Twice the default 64 KiB limit, then wait: the answer must come without the rest.
        while sent < 128 * 1024:
            sock.sendall(b"a" * 16384)
            sent += 16384
        status, headers, error, _ = read_response(sock)
        assert status == 431
        assert headers[b"connection"] == b"close"
        assert error["code"] == "request_header_fields_too_large"
        assert "65536" in error["message"]
        assert "http.max_head_bytes" in error["message"]
        # The rest is not read: the router closes its side, and sending more fails or
        # the connection ends.
        try:
            while sent < big:
                sock.sendall(b"a" * 65536)
                sent += 65536
        except (ConnectionResetError, BrokenPipeError):
            pass
        assert ends(sock)


def test_a_100_kib_url_is_414(spawn_router: Spawn) -> None:
    router = spawn_router(config())
    with connect(router) as sock:
        sock.sendall(b"GET /v1/models?q=" + b"u" * (100 * 1024) + b" HTTP/1.1\r\nhost: x\r\n\r\n")
        status, _, error, _ = read_response(sock)
        assert status == 414
        assert error["code"] == "uri_too_long"
        assert ends(sock)


def test_a_head_just_under_the_limit_is_served(spawn_router: Spawn) -> None:
    router = spawn_router(config(max_head_bytes=4096))
    with connect(router) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-pad: " + b"p" * 3000 + b"\r\n\r\n")
        response = _Response()
        while not response.done:
            data = sock.recv(65536)
            assert data
            response.parser.feed_data(data)
        assert response.status == 200
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-pad: " + b"p" * 5000 + b"\r\n\r\n")
        status, _, error, _ = read_response(sock)
        assert status == 431, error


def test_a_half_sent_head_or_body_gets_408_and_is_closed(spawn_router: Spawn) -> None:
    router = spawn_router(config(head_timeout="1s", body_timeout="1s"))
    with connect(router) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-")
        status, _, error, _ = read_response(sock)
        assert status == 408
        assert error["code"] == "request_timeout"
        assert "http.head_timeout" in error["message"]
        assert ends(sock)
    with connect(router) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n"
            % len(CHAT)
            + CHAT[:10]
        )
        status, _, error, _ = read_response(sock)
        assert status == 408
        assert "http.body_timeout" in error["message"]
        assert ends(sock)
    # A connection that never sends a byte is closed too, without an answer.
    with connect(router) as sock:
        assert sock.recv(100) == b""


def test_a_wrong_key_gets_401_without_100_continue_and_before_the_body(
    spawn_router: Spawn,
) -> None:
    router = spawn_router({**config(), "api_keys": ["right-key"]})
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 1048576\r\nexpect: 100-continue\r\n"
    )
    with connect(router) as sock:
        sock.sendall(head + b"authorization: Bearer wrong-key\r\n\r\n")
        status, headers, error, first = read_response(sock)
        assert first.startswith(b"HTTP/1.1 401 ")
        assert status == 401
        assert error["code"] == "invalid_api_key"
        assert headers[b"connection"] == b"close"
        assert ends(sock)
    # The right key still gets its `100 Continue`.
    with connect(router) as sock:
        sock.sendall(head + b"authorization: Bearer right-key\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")


def test_connections_beyond_the_bound_get_503(spawn_router: Spawn) -> None:
    router = spawn_router(config(max_connections=2))
    models = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n"
    held = [connect(router), connect(router)]
    try:
        for sock in held:
            sock.sendall(models)
            assert read_response_status(sock) == 200
        with connect(router) as extra:
            extra.sendall(models)
            status, headers, error, _ = read_response(extra)
            assert status == 503
            assert error["code"] == "too_many_connections"
            assert headers[b"retry-after"] == b"1"
            assert ends(extra)
        # Below the bound again: served.
        held.pop().close()

        def served() -> bool:
            with connect(router) as sock:
                sock.sendall(models)
                return read_response_status(sock) == 200

        wait_for(served, timeout=30, what="a connection below the bound served")
    finally:
        for sock in held:
            sock.close()


def read_response_status(sock: socket.socket) -> int:
    response = _Response()
    while not response.done:
        data = sock.recv(65536)
        if not data:
            return 0
        response.parser.feed_data(data)
    return response.status


# ---------------------------------------------------------------- config and pure logic


def load_config(tmp_path: Path, http: dict[str, Any]) -> RouterConfig:
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump({"http": http}))
    return validate(load(path, RouterConfig), str(path))


def test_http_defaults() -> None:
    http = RouterConfig().http
    assert http == HttpConfig()
    assert (http.max_head_bytes, http.head_timeout, http.body_timeout) == (65536, 10.0, 30.0)
    assert http.max_connections == 4096


@pytest.mark.parametrize(
    ("http", "field", "words"),
    [
        ({"head_timeout": 0}, "$.http.head_timeout", "must be > 0"),
        ({"body_timeout": "0s"}, "$.http.body_timeout", "must be > 0"),
        ({"head_timeout": "soon"}, "$.http.head_timeout", "duration"),
        ({"max_head_bytes": 100}, "$.http.max_head_bytes", ">= 1024"),
        ({"max_connections": 0}, "$.http.max_connections", ">= 1"),
        ({"max_conections": 5}, "max_conections", ""),
    ],
)
def test_bad_http_settings_are_named(
    tmp_path: Path, http: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path, http)
    assert field in str(err.value)
    assert words in str(err.value)


def test_http_settings_are_read(tmp_path: Path) -> None:
    cfg = load_config(
        tmp_path,
        {
            "max_head_bytes": 8192,
            "head_timeout": "500ms",
            "body_timeout": "2m",
            "max_connections": 9,
        },
    )
    assert cfg.http == HttpConfig(
        max_head_bytes=8192,
        head_timeout=Duration(0.5),
        body_timeout=Duration(120.0),
        max_connections=9,
    )


@given(st.integers(0, 1 << 20), st.integers(1024, 1 << 20), st.integers(0, 1 << 20))
def test_head_room_never_feeds_past_the_limit(seen: int, limit: int, size: int) -> None:
    room = head_room(seen, limit, size)
    assert 0 <= room <= size
    assert seen + room <= max(seen, limit)
    if seen + size <= limit:
        assert room == size
    elif seen < limit:
        assert seen + room == limit


def test_head_room_examples() -> None:
    assert head_room(0, 65536, 1000) == 1000
    assert head_room(65000, 65536, 1000) == 536
    assert head_room(65536, 65536, 1) == 0


@given(
    st.floats(0.001, 1e6, allow_nan=False),
    st.floats(0.001, 1e6, allow_nan=False),
    st.floats(0.001, 1e6, allow_nan=False),
)
def test_sweep_interval_is_bounded(keep_alive: float, head: float, body: float) -> None:
    every = sweep_interval(keep_alive, head, body)
    assert 0.05 <= every <= 5.0
    assert every <= max(0.05, min(keep_alive, head, body) / 4)
