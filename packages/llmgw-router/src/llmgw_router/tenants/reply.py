"""A :class:`~llmgw_router.proxy.context.Reply` that adds a limited key's
x-ratelimit-* headers to whatever response head goes out (the engine's answer, or an
error the router writes)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from llmgw_router.proxy.context import Reply
from llmgw_router.state import now
from llmgw_router.tenants.limits import KeyState, both_lines

__all__ = ["WithHeaders"]


class WithHeaders:
    """``inner`` with the key's x-ratelimit-* headers (``state``'s, at the moment the head
    goes out) appended to its response head."""

    __slots__ = ("body", "inner", "state")

    def __init__(self, inner: Reply, state: KeyState) -> None:
        self.inner = inner
        self.state = state
        # The body goes straight to the inner reply (no call of this one's per chunk).
        self.body: Callable[..., Coroutine[Any, Any, None]] = inner.body

    @property
    def gone(self) -> bool:
        return self.inner.gone

    @gone.setter
    def gone(self, value: bool) -> None:
        self.inner.gone = value

    @property
    def task(self) -> asyncio.Task[Any] | None:
        return self.inner.task

    @task.setter
    def task(self, value: asyncio.Task[Any] | None) -> None:
        self.inner.task = value

    # A plain function that hands back the inner reply's coroutine: no coroutine of its
    # own to create and step through.
    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> Coroutine[Any, Any, None]:
        state = self.state
        if state.requests is not None and state.tokens is not None:
            # A key with both rates (the usual case): KeyState.both_lines, the same as
            # its headers(), one call fewer on every response.
            return self.inner.start(
                status, both_lines(state.requests, state.tokens, now(), headers)
            )
        return self.inner.start(status, [*headers, *state.headers(now())])
