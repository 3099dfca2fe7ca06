"""The admission hot path's inline copies say what the plain functions say: a key's
x-ratelimit-* headers (KeyState.headers, refill and reset inline) are its buckets'
Bucket.lines, and their pre-serialized form (KeyState.head_block, the limits' template
filled in) is those lines as the head writer writes them, byte for byte."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_router.front.reply import HttpRequest, internal_error
from llmgw_router.state import now
from llmgw_router.tenants.limits import _REQUESTS, _TOKENS, KeyLimits, KeyState, Reservation

_steps = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=90.0),  # seconds later
        st.integers(min_value=0, max_value=5000),  # tokens reserved
        st.one_of(st.none(), st.integers(min_value=0, max_value=5000)),  # tokens used
    ),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(
    rpm=st.integers(min_value=1, max_value=10**8),
    tpm=st.integers(min_value=1, max_value=10**10),
    steps=_steps,
)
def test_headers_are_the_buckets_lines(rpm: int, tpm: int, steps: list[Any]) -> None:
    ks = KeyState(KeyLimits(rpm=rpm, tpm=tpm), 0.0)
    at = 0.0
    for later, tokens, used in steps:
        at += later
        got = ks.try_reserve(tokens, at)
        if isinstance(got, Reservation):
            ks.release(got, used, at + later / 2)
        at += later / 2
        assert ks.requests is not None
        assert ks.tokens is not None
        inline = ks.headers(at)
        assert inline == ks.requests.lines(at, _REQUESTS) + ks.tokens.lines(at, _TOKENS)


def _as_head(lines: list[tuple[bytes, bytes]]) -> bytes:
    return b"".join(b"%b: %b\r\n" % (name, value) for name, value in lines)


def _play(ks: KeyState, steps: list[Any]) -> float:
    """Reserve and release along ``steps``; the clock at the end."""
    at = 0.0
    for later, tokens, used in steps:
        at += later
        got = ks.try_reserve(tokens, at)
        if isinstance(got, Reservation):
            ks.release(got, used, at + later / 2)
        at += later / 2
    return at


@settings(max_examples=200, deadline=None)
@given(
    rpm=st.integers(min_value=0, max_value=10**8),
    tpm=st.integers(min_value=0, max_value=10**10),
    steps=_steps,
    resized=st.one_of(
        st.none(),
        st.tuples(
            st.integers(min_value=1, max_value=10**8), st.integers(min_value=1, max_value=10**10)
        ),
    ),
)
def test_head_block_is_the_headers_as_head_lines(
    rpm: int, tpm: int, steps: list[Any], resized: tuple[int, int] | None
) -> None:
    ks = KeyState(KeyLimits(rpm=rpm, tpm=tpm, max_concurrent=3), 0.0)
    at = _play(ks, steps)
    if resized is not None:
        # New limits (a new share): the template follows them.
        ks.set_limits(KeyLimits(rpm=resized[0], tpm=resized[1]), at)
        at += _play(ks, steps)
    later = at + 0.25
    # The same moment for both: head_block refills, headers then finds nothing to add.
    block = ks.head_block(later)
    assert block == _as_head(ks.headers(later))
    if ks.requests is None and ks.tokens is None:
        assert block == b""


def test_the_late_head_is_written_where_the_lines_were() -> None:
    """An HttpRequest with the key's state as its late head writes the very head that
    start(headers + the key's lines) writes; the router's own 500 drops them."""

    class Conn:
        transport = None
        lost = False
        draining = False
        write_paused = False

    ks = KeyState(KeyLimits(rpm=60, tpm=6000), 0.0)
    ks.try_reserve(100, 0.5)
    engine = [(b"content-type", b"application/json"), (b"content-length", b"2")]
    at = now()
    ks.requests.at = ks.tokens.at = at  # type: ignore[union-attr]

    def head(late: bool) -> bytes:
        request = HttpRequest(Conn())  # type: ignore[arg-type]
        request.headers = {b"x-request-id": b"rid-1"}
        if late:
            request.late_head = ks
            asyncio.run(request.start(200, engine))
            written = request._head_bytes(False, 2, False)
        else:
            asyncio.run(request.start(200, [*engine, *ks.headers(ks.tokens.at)]))  # type: ignore[union-attr]
            written = request._head_bytes(False, 2, False)
        return written

    written = head(late=True)
    # The same moment for the list: the buckets' clock is where the block left it.
    assert written == head(late=False)
    lines = written.split(b"\r\n")
    assert lines[1:4] == [
        b"x-request-id: rid-1",
        b"content-type: application/json",
        b"content-length: 2",
    ]
    assert [line.split(b":")[0] for line in lines[4:10]] == [
        b"x-ratelimit-limit-requests",
        b"x-ratelimit-remaining-requests",
        b"x-ratelimit-reset-requests",
        b"x-ratelimit-limit-tokens",
        b"x-ratelimit-remaining-tokens",
        b"x-ratelimit-reset-tokens",
    ]

    class Wire:
        def __init__(self) -> None:
            self.out = b""

        def write(self, data: bytes) -> None:
            self.out += data

    wire = Wire()

    class Written(Conn):
        transport = wire  # type: ignore[assignment]

        def response_done(self, request: HttpRequest) -> None:
            pass

    conn = Written()
    request = HttpRequest(conn)  # type: ignore[arg-type]
    request.late_head = ks
    asyncio.run(internal_error(request))
    assert wire.out.startswith(b"HTTP/1.1 500 ")
    assert b"x-ratelimit" not in wire.out
