"""The reply of a non-streamed request asked of the engine as a stream (issue 28).

:class:`Gathering` stands between the exchange and the client's reply: an event stream
(the resumable relay's, continuations already spliced in) is held and gathered by
:class:`~llmgw_router.proxy.gather.Answer` into the one JSON answer, written when the
stream ends; anything else (an engine's or the router's own JSON error answer) passes
through unchanged.
"""

from __future__ import annotations

import asyncio
from typing import Any

from llmgw_router.proxy.context import Reply, RequestContext
from llmgw_router.proxy.gather import Answer
from llmgw_router.proxy.resume import CHAT_PATH, split_events

__all__ = ["Gathering"]

# The stream's headers that do not describe a JSON answer.
_STREAM_ONLY = frozenset({b"content-type", b"content-length", b"cache-control"})


class Gathering:
    """A :class:`Reply` that turns an event stream into one JSON answer."""

    __slots__ = ("_answer", "_ctx", "_held", "_passing", "_status", "headers", "inner")

    def __init__(self, inner: Reply, ctx: RequestContext) -> None:
        self.inner = inner
        self._ctx = ctx
        self._answer = Answer(chat=ctx.path == CHAT_PATH)
        self._held = b""
        self._passing = False
        self._status = 0
        self.headers: list[tuple[bytes, bytes]] = []

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
        streamed = any(
            name == b"content-type" and value.startswith(b"text/event-stream")
            for name, value in headers
        )
        if status != 200 or not streamed:
            self._passing = True
            await self.inner.start(status, headers)
            return
        self._status = status
        self.headers = [(k, v) for k, v in headers if k not in _STREAM_ONLY]

    async def body(self, data: bytes, more: bool = False) -> None:
        if self._passing:
            await self.inner.body(data, more)
            return
        events, self._held = split_events(self._held + data)
        for event in events:
            self._answer.feed(event)
        if more:
            return
        if self._held.strip():
            self._answer.feed(self._held)
            self._held = b""
        status, answer = self._answer.result()
        if status != 200:
            # Counted as the failure it is.
            self._ctx.status = status
        await self.inner.start(
            status,
            [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(answer)),
                *self.headers,
            ],
        )
        await self.inner.body(answer)
