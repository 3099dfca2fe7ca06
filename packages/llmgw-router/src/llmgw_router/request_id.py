"""Every answer carries a request id (`x-request-id`), the client's or a new one.

A client's own id passes through when it is a plain token (1 to 128 visible ASCII
characters); otherwise, or without one, the router makes one (32 hex digits). The
id is put among the request's headers as soon as its head is read, so the engine
gets the same id (route.py forwards `x-request-id`) and the router's log, the
engine's log and the client can be matched.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

__all__ = ["HEADER", "MAX_LENGTH", "acceptable", "ensure", "new_id"]

HEADER = b"x-request-id"
MAX_LENGTH = 128


def new_id() -> bytes:
    return os.urandom(16).hex().encode()


def acceptable(value: bytes) -> bool:
    """A client's id that may be passed through: 1-128 visible ASCII, no spaces."""
    return 0 < len(value) <= MAX_LENGTH and all(0x21 <= b <= 0x7E for b in value)


def ensure(headers: MutableMapping[bytes, bytes]) -> bytes:
    """The request's id, set among ``headers`` (lower-case names) when it had none usable."""
    given = headers.get(HEADER)
    if given is not None and acceptable(given):
        return given
    made = headers[HEADER] = new_id()
    return made


def with_id(head: list[tuple[bytes, bytes]], request_id: bytes) -> list[tuple[bytes, bytes]]:
    """Response headers with the request's id (one an engine sent in its place dropped)."""
    return [*(h for h in head if h[0] != HEADER), (HEADER, request_id)]
