"""An engine's output to the control plane, on request (``llmgw-control logs``, issue 29).

A LogsRequest names a shard, a tail count and whether to follow; the agent answers
with LogsChunk messages on the same stream: the last ``tail`` lines of the engine's
output file, then (following) what the engine writes next, polled like
:class:`~llmgw_agent.output.OutputFollower` does. Bounded everywhere:

- a chunk holds at most :data:`MAX_LINES` lines and :data:`MAX_BYTES` bytes (a longer
  line is cut), and a follow reads at most a few chunks' worth of the file per poll;
- a subscription sends a chunk only with credit: the control plane gives ``credit``
  chunks with the request and one more (LogsCredit) each time it has passed one on to
  its reader; a reader that does not keep up stops the chunks, not the stream's other
  messages (at most ``credit`` chunks of one subscription wait in the outbox);
- at most :data:`MAX_SUBSCRIPTIONS` at once; more are refused with a chunk that says so.

The lines go through the shard's own filter and mask (the agent's polls left out, the
engine's API key shown as ``***``). A new stream ends every subscription of the old one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
from llmgw_proto import v1

from llmgw_agent.output import OutputFollower, file_tail

__all__ = ["MAX_BYTES", "MAX_LINES", "MAX_SUBSCRIPTIONS", "LogSubscriptions", "chunks"]

log = structlog.get_logger(__name__)

MAX_LINES = 200
MAX_BYTES = 32 * 1024
MAX_SUBSCRIPTIONS = 8
MAX_TAIL = 10_000
MAX_CREDIT = 64
POLL = 0.2


def chunks(
    lines: list[str], max_lines: int = MAX_LINES, max_bytes: int = MAX_BYTES
) -> list[list[str]]:
    """``lines`` in chunks of at most ``max_lines`` lines and ``max_bytes`` bytes (UTF-8);
    a line longer than ``max_bytes`` alone is cut to fit. Pure."""
    out: list[list[str]] = []
    current: list[str] = []
    size = 0
    for line in lines:
        data = line.encode()
        if len(data) > max_bytes:
            line = data[: max_bytes - 3].decode(errors="ignore") + "..."
            data = line.encode()
        if current and (len(current) >= max_lines or size + len(data) + 1 > max_bytes):
            out.append(current)
            current, size = [], 0
        current.append(line)
        size += len(data) + 1
    if current:
        out.append(current)
    return out


@dataclass(eq=False)
class _Subscription:
    request: v1.LogsRequest
    credit: int
    more: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    # Where following starts: the file's end when asked (-1: it could not be read).
    offset: int = -1


class LogSubscriptions:
    def __init__(
        self,
        output_of: Callable[[str], OutputFollower | None],
        send: Callable[[v1.AgentMessage], None],
        *,
        poll: float = POLL,
    ) -> None:
        self.output_of = output_of
        self.send = send
        self.poll = poll
        self.subscriptions: dict[str, _Subscription] = {}

    def handle(self, message: v1.ControlMessage) -> bool:
        """Take a logs message (True), or leave it to the command dispatch (False)."""
        if message.logs_request is not None:
            self._start(message.logs_request)
        elif message.logs_credit is not None:
            sub = self.subscriptions.get(message.logs_credit.subscription_id)
            if sub is not None:
                sub.credit = min(sub.credit + message.logs_credit.chunks, MAX_CREDIT)
                sub.more.set()
        elif message.logs_cancel is not None:
            self._end(message.logs_cancel.subscription_id)
        else:
            return False
        return True

    def reset(self) -> None:
        """A new stream: what the old one asked for is no longer read by anyone."""
        for sid in list(self.subscriptions):
            self._end(sid)

    def _end(self, sid: str) -> None:
        sub = self.subscriptions.pop(sid, None)
        if sub is not None and sub.task is not None:
            sub.task.cancel()

    def _start(self, request: v1.LogsRequest) -> None:
        sid = request.subscription_id
        if not sid or sid in self.subscriptions:
            return
        if len(self.subscriptions) >= MAX_SUBSCRIPTIONS:
            why = f"too many log readers on this node (at most {MAX_SUBSCRIPTIONS})"
            self.send(_chunk(sid, [], end=True, error=why))
            return
        sub = _Subscription(request, credit=max(1, min(request.credit or 1, MAX_CREDIT)))
        follower = self.output_of(request.shard_id)
        if follower is not None:
            with contextlib.suppress(OSError):
                sub.offset = follower.path.stat().st_size
        self.subscriptions[sid] = sub
        sub.task = asyncio.get_running_loop().create_task(self._run(sub))
        log.info("engine logs asked", subscription=sid[:40], shard=request.shard_id[:200],
                 tail=request.tail, follow=request.follow)  # fmt: skip

    async def _put(self, sub: _Subscription, lines: list[str]) -> None:
        for part in chunks(lines):
            while sub.credit <= 0:
                sub.more.clear()
                await sub.more.wait()
            sub.credit -= 1
            self.send(_chunk(sub.request.subscription_id, part))

    async def _run(self, sub: _Subscription) -> None:
        sid = sub.request.subscription_id
        error = ""
        try:
            follower = self.output_of(sub.request.shard_id)
            if follower is None:
                error = f"shard {sub.request.shard_id[:200]!r} does not run on this node"
                return
            path, skip, secret = follower.path, follower.skip, follower.secret
            offset = sub.offset
            if offset < 0:
                error = f"cannot read the engine's output file {path}"
                return
            tail = min(sub.request.tail, MAX_TAIL)
            if tail:
                await self._put(sub, file_tail(path, tail, skip, secret).splitlines())
            partial = b""
            while sub.request.follow:
                await asyncio.sleep(self.poll)
                try:
                    size = path.stat().st_size
                    if size < offset:
                        offset, partial = 0, b""  # truncated past its size limit
                    if size == offset:
                        continue
                    with path.open("rb") as f:
                        f.seek(offset)
                        data = f.read(min(size - offset, 4 * MAX_BYTES))
                except OSError:
                    continue  # the engine's file went with its shard: wait for a cancel
                offset += len(data)
                parts = (partial + data).split(b"\n")
                partial = parts.pop()
                if len(partial) > MAX_BYTES:
                    parts.append(partial)
                    partial = b""
                lines = [
                    line.replace(secret, "***") if secret else line
                    for raw in parts
                    if not skip(line := raw.decode(errors="replace").rstrip("\r"))
                ]
                await self._put(sub, lines)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            log.exception("engine logs failed", subscription=sid[:40])
            error = f"reading the engine's output failed: {err}"
        finally:
            if self.subscriptions.get(sid) is sub:
                del self.subscriptions[sid]
                with contextlib.suppress(Exception):
                    self.send(_chunk(sid, [], end=True, error=error))


def _chunk(sid: str, lines: list[str], *, end: bool = False, error: str = "") -> v1.AgentMessage:
    return v1.AgentMessage(
        logs_chunk=v1.LogsChunk(subscription_id=sid, lines=lines, end=end, error=error)
    )
