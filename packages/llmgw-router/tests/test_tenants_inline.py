"""The admission hot path's inline copies say what the plain functions say: a key's
x-ratelimit-* headers (KeyState.headers, refill and reset inline) are its buckets'
Bucket.lines."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
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
