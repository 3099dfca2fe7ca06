"""A :class:`~llmgw_router.proxy.context.Reply` that adds a limited key's
x-ratelimit-* headers to whatever response head goes out (the engine's answer, or an
error the router writes)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from llmgw_router.proxy.context import Reply

__all__ = ["WithHeaders"]


class WithHeaders:
    """``inner`` with ``extra()`` appended to its response head."""

    __slots__ = ("_extra", "inner")

    def __init__(self, inner: Reply, extra: Callable[[], list[tuple[bytes, bytes]]]) -> None:
        self.inner = inner
        self._extra = extra

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

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await self.inner.start(status, [*headers, *self._extra()])

    async def body(self, data: bytes, more: bool = False) -> None:
        await self.inner.body(data, more)
