"""The admin HTTP listener bounds what a client sends (issue 24).

Against a real ``llmgw-control serve`` process on raw sockets: a long request line is
answered 414, an oversized head or too many header lines 431, a head or body that
does not arrive in time 408, and connections beyond the bound 503 with Retry-After;
each answer is a clear JSON error, and the listener serves normally afterwards.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from llmgw_control.admin import (
    HEAD_TIMEOUT,
    MAX_CONNECTIONS,
    MAX_HEAD,
    MAX_HEADERS,
    head_problem,
    overlong_head,
)
from llmgw_testkit import wait_for

Control = Any  # tests/conftest.py's Control: a `llmgw-control serve` process


@pytest.fixture
def control(control_factory: Callable[..., Control]) -> Control:
    models = [{"name": "m", "profiles": {"p": {"engine": "vllm", "gpus_per_node": 1}}}]
    return control_factory(models)


def _connect(control: Control) -> socket.socket:
    return socket.create_connection(("127.0.0.1", control.admin_port), timeout=HEAD_TIMEOUT * 4)


def _answer(sock: socket.socket) -> tuple[int, dict[str, str], Any]:
    """Read until the listener closes: status, headers (lower-case names), JSON body."""
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    assert got, "the connection closed without an answer"
    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    return int(lines[0].split(" ")[1]), headers, json.loads(body)


def _ask(control: Control, data: bytes) -> tuple[int, dict[str, str], Any]:
    with _connect(control) as sock:
        sock.sendall(data)
        return _answer(sock)


def test_a_long_request_line_is_414_a_big_head_431(control: Control) -> None:
    status, _, body = _ask(control, b"GET /v1/status?q=" + b"u" * (MAX_HEAD + 100))
    assert status == 414
    assert f"{MAX_HEAD} bytes" in body["error"]
    big = b"GET /v1/status HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (MAX_HEAD + 100) + b"\r\n\r\n"
    status, _, body = _ask(control, big)
    assert status == 431
    assert "request head" in body["error"]


def test_too_many_header_lines_is_431(control: Control) -> None:
    many = b"".join(b"x-h%d: v\r\n" % i for i in range(MAX_HEADERS + 1))
    status, _, body = _ask(control, b"GET /v1/status HTTP/1.1\r\n" + many + b"\r\n")
    assert status == 431
    assert f"at most {MAX_HEADERS}" in body["error"]
    # Just at the bound it is served.
    fewer = b"".join(b"x-h%d: v\r\n" % i for i in range(MAX_HEADERS))
    status, _, _ = _ask(control, b"GET /v1/status HTTP/1.1\r\n" + fewer + b"\r\n")
    assert status == 200


def test_a_slow_head_or_body_is_408(control: Control) -> None:
    half_head = b"GET /v1/status HTTP/1.1\r\nhost: "
    half_body = b"GET /v1/status HTTP/1.1\r\ncontent-length: 100\r\n\r\n{"
    with ThreadPoolExecutor(2) as pool:
        head, body = pool.map(lambda data: _ask(control, data), [half_head, half_body])
    assert head[0] == 408
    assert "request head did not arrive" in head[2]["error"]
    assert body[0] == 408
    assert "request body did not arrive" in body[2]["error"]


def test_connections_beyond_the_bound_get_503(control: Control) -> None:
    held = [_connect(control) for _ in range(MAX_CONNECTIONS)]
    try:
        # Connections are counted as the listener takes them: ask until it has all.
        def refused() -> dict[str, str] | None:
            status, headers, body = _ask(control, b"GET /healthz HTTP/1.1\r\n\r\n")
            if status != 503:
                return None
            assert f"limit of {MAX_CONNECTIONS} connections" in body["error"]
            return headers

        headers = wait_for(refused, timeout=HEAD_TIMEOUT / 2, what="a 503 past the bound")
        assert headers["retry-after"] == "1"
    finally:
        for sock in held:
            sock.close()
    # Once they are gone the listener serves again.
    wait_for(
        lambda: _healthz(control) == 200, timeout=HEAD_TIMEOUT * 3, what="/healthz served again"
    )


def _healthz(control: Control) -> int:
    with _connect(control) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
        return int(got.split(b" ")[1])


@given(st.integers(0, 3 * MAX_HEADERS), st.sampled_from(["GET", "POST", "HEAD"]))
def test_header_lines_over_the_bound_are_431(count: int, method: str) -> None:
    head = f"{method} /v1/status HTTP/1.1\r\n".encode() + b"x: y\r\n" * count + b"\r\n"
    problem = head_problem(head)
    if count > MAX_HEADERS:
        assert problem is not None
        assert problem[0] == 431
        assert f"{count} header lines" in json.loads(problem[2])["error"]
    else:
        assert problem is None


@given(st.binary(max_size=300))
def test_any_head_is_judged_without_raising(head: bytes) -> None:
    problem = head_problem(head + b"\r\n\r\n")
    assert problem is None or problem[0] in (400, 431)
    assert overlong_head(head)[0] == (431 if b"\n" in head else 414)
