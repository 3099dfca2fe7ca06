"""One engine process of one shard: its record, how its exit is seen and told, and how
it is stopped (SIGTERM to its process group, SIGKILL after a grace).

The :class:`~llmgw_agent.supervisor.Supervisor` launches and watches engines; what
concerns one process alone lives here.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import structlog
from llmgw_proto import v1

from llmgw_agent.adapters import Adapter, Launch
from llmgw_agent.output import OutputFollower, Skip, poll_lines
from llmgw_agent.procs import process_start_ticks, signal_name
from llmgw_agent.records import ShardRecord

__all__ = ["Engine", "exit_text", "has_exited", "now", "own_polls", "terminate", "wait_exit"]

log = structlog.get_logger(__name__)

S = v1.ShardState


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


@dataclass
class Engine:
    """One engine process of one shard: its record, and everything watching it."""

    record: ShardRecord
    adapter: Adapter
    path: Path
    output: OutputFollower
    popen: subprocess.Popen[bytes] | None
    state: v1.ShardState = S.STARTING
    adopted: bool = False
    # Set once the agent asked it to stop: its exit is then STOPPED, not FAILED.
    stop_reason: str = ""
    # Set when the agent kills it for a failure of its own (load timeout).
    fail_reason: str = ""
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    lifecycle: asyncio.Task[None] | None = None
    exit_code: int | None = None
    exit_signal: int | None = None

    @property
    def start(self) -> v1.StartShard:
        return self.record.start

    @property
    def shard_id(self) -> str:
        return self.record.start.shard_id

    @property
    def pid(self) -> int:
        return self.record.pid

    def save(self) -> None:
        self.record.state = self.state.name
        self.record.save(self.path)

    def transition(self, state: v1.ShardState, reason: str, *, tail_lines: int) -> v1.ShardStatus:
        """Move to ``state``: the ShardStatus that tells it (a FAILED one with the output's
        last ``tail_lines``; a READY one with the endpoint and its key)."""
        self.state = state
        launch = self.record.launch
        if state == S.READY and launch.endpoint_warning:
            reason = f"{reason}; WARNING: {launch.endpoint_warning}"
        status = v1.ShardStatus(
            shard_id=self.shard_id,
            replica_id=self.start.replica_id,
            state=state,
            reason=reason,
            endpoint_url=launch.endpoint_url if state == S.READY else "",
            time=now(),
            pid=self.pid,
            port=self.start.port,
            gpu_indices=list(self.start.gpu_indices),
            api_key=launch.api_key if state == S.READY else "",
            role=self.start.role,
            kv_port=self.start.kv_port,
        )
        if state in (S.FAILED, S.STOPPED):
            status.exit_code = self.exit_code
            status.signal = self.exit_signal
        if state == S.FAILED:
            status.output_tail = self.output.tail(tail_lines)
        return status


def exit_text(engine: Engine) -> str:
    if engine.exit_signal is not None:
        return f"killed by {signal_name(engine.exit_signal)}"
    if engine.exit_code is not None:
        return f"exit code {engine.exit_code}"
    return "exit code unknown (started by a previous agent, so not this agent's child)"


async def wait_exit(engine: Engine) -> None:
    loop = asyncio.get_running_loop()
    fd = -1
    with contextlib.suppress(OSError, AttributeError):
        fd = os.pidfd_open(engine.pid)
    exited = asyncio.Event()
    if fd >= 0:
        # The pidfd turns readable when the process ends: no polling while it runs.
        loop.add_reader(fd, exited.set)
    try:
        while not has_exited(engine):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5 if fd < 0 else 5.0):
                    await exited.wait()
    finally:
        if fd >= 0:
            loop.remove_reader(fd)
            os.close(fd)
    engine.exited.set()


def has_exited(engine: Engine) -> bool:
    if engine.popen is not None:
        code = engine.popen.poll()
        if code is None:
            return False
        if code < 0:
            engine.exit_signal = -code
        else:
            engine.exit_code = code
        return True
    return process_start_ticks(engine.pid) != engine.record.pid_start


async def terminate(engine: Engine, grace: float) -> None:
    """SIGTERM to the whole group, then SIGKILL after ``grace`` seconds."""
    if engine.exited.is_set():
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(engine.pid, signal.SIGTERM)
    try:
        async with asyncio.timeout(grace):
            await engine.exited.wait()
    except TimeoutError:
        log.warning("engine ignored SIGTERM; killing", shard=engine.shard_id, grace=grace)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(engine.pid, signal.SIGKILL)


def own_polls(launch: Launch) -> Skip:
    """The engine's access lines for this agent's health and metrics polls."""
    return poll_lines(urlsplit(url).path for url in (launch.health_url, launch.metrics_url) if url)
