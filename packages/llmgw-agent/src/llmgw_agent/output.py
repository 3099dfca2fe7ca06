"""Following an engine's output file into a ring buffer and the agent's own log.

Engines write to a file, never a pipe (a pipe would die with the agent and take the
engine with it). The file is truncated past a size limit; the last lines stay in memory
for the output tail of a FAILED status.

The engine's access lines for the agent's own polls (its health and metrics URLs, answered
200, about two a second) are left in the file but kept out of the tail and the agent's log:
otherwise a 40-line tail is nothing but polls seconds after the engine went quiet, and the
lines that say why it died are pushed out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path

import structlog

__all__ = ["OutputFollower", "file_tail", "poll_lines"]

engine_log = structlog.get_logger("llmgw_agent.engine")

Skip = Callable[[str], bool]


def _never(line: str) -> bool:
    return False


def poll_lines(paths: Iterable[str]) -> Skip:
    """Whether a line is an engine's access line for a successful GET of one of ``paths``.

    uvicorn (vLLM, SGLang): ``INFO:     127.0.0.1:5400 - "GET /metrics HTTP/1.1" 200 OK``,
    with vLLM's ``(APIServer pid=N)`` before it; llama-server:
    ``srv  log_server_r: request: GET /health 127.0.0.1 200``. Another status (a 503 while
    loading, a 500) is kept: it says something.
    """
    alternatives = "|".join(re.escape(p) for p in sorted(set(paths)) if p)
    if not alternatives:
        return _never
    pattern = re.compile(
        rf'"GET (?:{alternatives})(?:\?\S*)? HTTP/[0-9.]+" 200\b'
        rf"|\brequest: GET (?:{alternatives})(?:\?\S*)? \S+ 200\s*$"
    )
    return lambda line: pattern.search(line) is not None


class OutputFollower:
    def __init__(
        self,
        path: Path,
        shard_id: str,
        *,
        lines: int,
        max_bytes: int,
        skip: Skip = _never,
        secret: str = "",
    ) -> None:
        self.path = path
        self.skip = skip
        # The engine's API key: an engine that prints its arguments (SGLang's server_args)
        # must not put it into the agent's log or a status's output tail.
        self.secret = secret
        self.shard_id = shard_id
        self.lines: deque[str] = deque(maxlen=lines)
        self.max_bytes = max_bytes
        self.offset = 0
        self._partial = b""

    def refill(self) -> None:
        """Fill the buffer from the end of an existing file (an adopted engine's history)."""
        try:
            size = self.path.stat().st_size
            start = max(0, size - 64 * 1024)
            with self.path.open("rb") as f:
                f.seek(start)
                recent = f.read(size - start).decode(errors="replace").splitlines()
        except OSError:
            return
        # A read that starts mid-file starts mid-line: drop that first fragment.
        recent = recent[1:] if start else recent
        self.lines.extend(_masked(line, self.secret) for line in recent if not self.skip(line))
        self.offset = size

    def tail(self, lines: int) -> str:
        return "\n".join(list(self.lines)[-lines:])

    async def follow(self) -> None:
        """Until cancelled; whatever the engine wrote last (often why it died) is read."""
        try:
            while True:
                self.read_more()
                await asyncio.sleep(0.2)
        finally:
            self.read_more(final=True)

    def read_more(self, *, final: bool = False) -> None:
        try:
            size = self.path.stat().st_size
            if size < self.offset:
                self.offset = 0  # truncated
            if size == self.offset and not (final and self._partial):
                return
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read(size - self.offset)
        except OSError:
            return
        self.offset += len(data)
        chunks = (self._partial + data).split(b"\n")
        self._partial = chunks.pop()
        if final and self._partial:
            chunks.append(self._partial)
            self._partial = b""
        for raw in chunks:
            line = raw.decode(errors="replace").rstrip("\r")
            if self.skip(line):
                continue
            line = _masked(line, self.secret)
            self.lines.append(line)
            engine_log.info(line, shard=self.shard_id)
        if self.offset > self.max_bytes:
            # The engine appends (O_APPEND), so after truncation it writes at the new end.
            # Lines written between the read and the truncation are lost; the tail survives.
            with contextlib.suppress(OSError):
                os.truncate(self.path, 0)
                self.offset = 0


def _masked(line: str, secret: str) -> str:
    return line.replace(secret, "***") if secret else line


def file_tail(path: Path, lines: int, skip: Skip = _never, secret: str = "") -> str:
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - 64 * 1024))
            kept = [
                _masked(line, secret)
                for line in f.read().decode(errors="replace").splitlines()
                if not skip(line)
            ]
            return "\n".join(kept[-lines:])
    except OSError:
        return ""
