"""The supervisor's record of each worker: its slot and its forked process."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

__all__ = ["Forked", "Slot"]


class Forked:
    """A forked worker, with the little of `subprocess.Popen` the supervisor uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode


@dataclass
class Slot:
    index: int
    proc: Forked | None = None
    started_at: float = 0.0
    up: bool = False  # its admin socket answered /healthz
    restarts: int = 0
    attempt: int = 0
    restart_at: float = 0.0
    history: list[int] = field(default_factory=list)
