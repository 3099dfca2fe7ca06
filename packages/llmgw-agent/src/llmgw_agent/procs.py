"""Process identity from /proc: is the process with this pid still the one we launched?

A pid alone is not an identity (pids are reused); the start time in clock ticks since
boot and the command line together are.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

__all__ = ["cmdline_matches", "is_same_process", "process_cmdline", "process_start_ticks"]


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
