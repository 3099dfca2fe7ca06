"""Process identity from /proc: is the process with this pid still the one we launched?

A pid alone is not an identity (pids are reused); the start time in clock ticks since
boot and the command line together are. Engines also carry a mark in their environment
(:func:`marks`), so the engines of an agent can be found from the processes alone
(:func:`marked_processes`), as kubelet asks the runtime rather than a checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Marked",
    "cmdline_matches",
    "is_same_process",
    "marked_processes",
    "marks",
    "parse_environ",
    "process_cmdline",
    "process_start_ticks",
    "read_mark",
    "stop_group",
]


def process_start_ticks(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot; None if gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: fields start after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    if not fields or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def process_cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0")[:-1]]


def cmdline_matches(argv: list[str], cmdline: list[str]) -> bool:
    """Whether a process's command line is the one launched from ``argv``.

    A script with a ``#!`` line shows up as ``interpreter [arg] /path/script args…``,
    so the arguments must match exactly and the program's name must be among the
    words that come before them.
    """
    if cmdline == argv:
        return True
    if not argv or len(cmdline) < len(argv):
        return False
    tail = len(argv) - 1
    if tail and cmdline[-tail:] != argv[1:]:
        return False
    head = cmdline[: len(cmdline) - tail]
    program = os.path.basename(argv[0])
    return any(os.path.basename(word) == program for word in head)


def is_same_process(pid: int, start_ticks: int, argv: list[str]) -> bool:
    """``pid`` runs, started at ``start_ticks``, with the command line ``argv``."""
    for _ in range(40):
        if process_start_ticks(pid) != start_ticks:
            return False
        cmdline = process_cmdline(pid)
        if cmdline:
            return cmdline_matches(argv, cmdline)
        # Empty while the kernel is still setting up a process that is being exec'd
        # (an engine launched a moment ago): look again shortly.
        time.sleep(0.05)
    return False


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# Every engine process carries these in its environment (its children inherit them):
# a restarted agent finds its engines from the processes themselves, even when a
# record is missing or torn.
SHARD_ENV = "LLMGW_SHARD"
AGENT_ENV = "LLMGW_AGENT"
PORT_ENV = "LLMGW_PORT"
GPUS_ENV = "LLMGW_GPUS"


@dataclass(frozen=True)
class Marked:
    """A process that carries an engine's mark: whose shard, and what it holds."""

    pid: int
    pgid: int
    start_ticks: int
    shard_id: str
    port: int
    gpus: tuple[int, ...]


def marks(shard_id: str, agent: str, port: int, gpus: Sequence[int]) -> dict[str, str]:
    """The environment variables that mark one engine process of this agent."""
    return {
        SHARD_ENV: shard_id,
        AGENT_ENV: agent,
        PORT_ENV: str(port),
        GPUS_ENV: ",".join(str(g) for g in gpus),
    }


def parse_environ(raw: bytes) -> dict[str, str]:
    """``/proc/PID/environ`` (NUL-separated NAME=value) as a dict; junk entries skipped."""
    env: dict[str, str] = {}
    for entry in raw.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if sep and name:
            env[name.decode(errors="replace")] = value.decode(errors="replace")
    return env


def read_mark(env: Mapping[str, str], agent: str) -> tuple[str, int, tuple[int, ...]] | None:
    """(shard id, port, GPUs) when ``env`` marks an engine of ``agent``, else None."""
    shard = env.get(SHARD_ENV, "")
    if not shard or env.get(AGENT_ENV) != agent:
        return None
    port = _number(env.get(PORT_ENV, ""))
    gpus = tuple(g for g in map(_number, env.get(GPUS_ENV, "").split(",")) if g is not None)
    return shard, port if port is not None and 0 < port < 65536 else 0, gpus


def _number(text: str) -> int | None:
    return int(text) if text.isascii() and text.isdigit() and len(text) < 10 else None


def _stat_fields(pid: int) -> list[str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()


def marked_processes(agent: str, proc: Path = Path("/proc")) -> list[Marked]:
    """The live processes of this user marked as engines of ``agent``."""
    uid = os.getuid()
    found: list[Marked] = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            if entry.stat().st_uid != uid:
                continue
            raw = (entry / "environ").read_bytes()
        except OSError:
            continue  # gone, or not ours to read
        mark = read_mark(parse_environ(raw), agent)
        fields = _stat_fields(pid)
        if mark is None or not fields or fields[0] in ("Z", "X"):
            continue
        found.append(Marked(pid, int(fields[2]), int(fields[19]), *mark))
    return found


def _still_there(m: Marked) -> bool:
    """``m`` runs, or is a zombie whose other threads still exit (its files still open)."""
    fields = _stat_fields(m.pid)
    if not fields or int(fields[19]) != m.start_ticks:
        return False
    if fields[0] not in ("Z", "X"):
        return True
    # A thread-group leader turns zombie before its other threads are done: until they
    # are, the open files (the engine's listening socket) are not closed.
    try:
        return len(os.listdir(f"/proc/{m.pid}/task")) > 1
    except OSError:
        return False


def group_alive(members: Sequence[Marked]) -> bool:
    """Whether any of these processes still runs (the same process: pid and start time)."""
    return any(_still_there(m) for m in members)


async def stop_group(pgid: int, members: Sequence[Marked], grace: float) -> bool:
    """SIGTERM to the group, SIGKILL after ``grace``; True when every member is gone."""

    async def gone(within: float) -> bool:
        deadline = time.monotonic() + within
        while group_alive(members):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    clean = await gone(grace)
    # Whatever is left of the group goes, as after any engine's exit.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    return clean or await gone(10.0)
