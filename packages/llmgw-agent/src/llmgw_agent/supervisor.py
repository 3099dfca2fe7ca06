"""Supervision of engine processes: launch, health, drain, stop, exit, re-adoption.

Each engine runs in its own session (so its own process group) and writes its
output to a file in the state directory, not to a pipe: a pipe would die with
the agent and take the engine with it (SIGPIPE) on the next agent upgrade. The
agent tails that file into a ring buffer and its own log, and the file lets a
restarted agent keep reading the output of engines it re-adopts.

Every running shard is recorded in ``state_dir/shards/<shard>.json``; a new
agent re-adopts the engines whose pid is alive with the same start time and
command line, and supervises them by pid.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import os
import re
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import structlog
from llmgw_proto import v1

from llmgw_agent.adapters import Adapter, Launch, adapter_for, build_launch
from llmgw_agent.config import AgentConfig
from llmgw_agent.probe import http_get, metric_value
from llmgw_agent.validation import NodeView, Probes, real_probes, validate

__all__ = [
    "ShardRecord",
    "Supervisor",
    "cmdline_matches",
    "live_records",
    "process_start_ticks",
]

log = structlog.get_logger(__name__)
engine_log = structlog.get_logger("llmgw_agent.engine")

StatusSink = Callable[[v1.ShardStatus], None]
S = v1.ShardState


class ShardRecord(msgspec.Struct, kw_only=True):
    """One running shard as recorded in the state directory."""

    shard_id: str
    replica_id: str
    model: str
    profile: str
    engine: str
    pid: int
    # /proc/PID/stat start time: a reused pid has another one.
    pid_start: int
    argv: list[str]
    env: dict[str, str]
    started_at: float
    port: int
    gpu_indices: list[int]
    rank: int
    world_size: int
    endpoint_url: str
    health_url: str
    metrics_url: str
    headless: bool
    load_timeout: float
    state: str
    output_path: str
    # The StartShard itself, serialized, so nothing of it is lost.
    start_shard: str


def _safe_name(shard_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", shard_id) or "_"


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


def _record_alive(record: ShardRecord) -> bool:
    for _ in range(40):
        if process_start_ticks(record.pid) != record.pid_start:
            return False
        cmdline = process_cmdline(record.pid)
        if cmdline:
            return cmdline_matches(record.argv, cmdline)
        # Empty while the kernel is still setting up a process that is being exec'd
        # (an engine launched a moment ago): look again shortly.
        time.sleep(0.05)
    return False


def _read_records(state_dir: Path) -> list[tuple[Path, ShardRecord | None]]:
    out: list[tuple[Path, ShardRecord | None]] = []
    shards = state_dir / "shards"
    if not shards.is_dir():
        return out
    for path in sorted(shards.glob("*.json")):
        try:
            out.append((path, msgspec.json.decode(path.read_bytes(), type=ShardRecord)))
        except (OSError, msgspec.DecodeError):
            out.append((path, None))
    return out


def live_records(state_dir: Path) -> list[ShardRecord]:
    """Recorded shards whose engine still runs (same pid, start time and command line)."""
    return [r for _, r in _read_records(state_dir) if r is not None and _record_alive(r)]


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass
class Engine:
    """One engine process of one shard, and everything watching it."""

    start: v1.StartShard
    adapter: Adapter
    launch: Launch
    record: ShardRecord
    record_path: Path
    popen: subprocess.Popen[bytes] | None
    state: v1.ShardState = S.STARTING
    adopted: bool = False
    output: deque[str] = field(default_factory=deque)
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
    # Where following the output file starts (an adopted engine's file has history).
    output_offset: int = 0

    @property
    def shard_id(self) -> str:
        return self.start.shard_id

    @property
    def pid(self) -> int:
        return self.record.pid


class Supervisor:
    """All engines of this node. Transitions go to ``sink`` as ShardStatus messages."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        gpus: dict[int, bool],
        simulated: bool,
        sink: StatusSink,
        probes: Probes | None = None,
    ) -> None:
        self.config = config
        self.gpus = gpus
        self.simulated = simulated
        self.sink = sink
        self.probes = probes or real_probes()
        self.state_dir = Path(config.state_dir).expanduser()
        self.engines: dict[str, Engine] = {}
        self._closing = False

    # ---- commands -------------------------------------------------------------------

    def start(self, start: v1.StartShard) -> v1.CommandResult:
        """Validate and launch; returns at once (loading is watched in the background)."""
        result = v1.CommandResult(command_id=start.command_id, ok=True)
        if start.shard_id in self.engines:
            result.error = (
                f"shard {start.shard_id} already runs (pid {self.engines[start.shard_id].pid})"
            )
            return result
        self._emit_for(start, S.VALIDATING, reason="checking the profile before launch")
        adapter = adapter_for(start.engine)
        command = self.engine_command(adapter)
        problems = validate(
            start,
            adapter,
            command,
            self.node_view(),
            self.probes,
            bind_host=self.config.engine_host,
        )
        if problems or adapter is None:
            return self._refuse(start, "validation failed: " + "; ".join(problems))
        launch = build_launch(
            adapter,
            start,
            command,
            bind_host=self.config.engine_host,
            endpoint_host=self.config.endpoint_host(),
        )
        try:
            engine = self._spawn(start, adapter, launch)
        except OSError as err:
            return self._refuse(start, f"could not launch {launch.argv[0]!r}: {err}")
        self.engines[start.shard_id] = engine
        self._emit(engine, S.STARTING, reason=f"launched pid {engine.pid}")
        engine.lifecycle = asyncio.create_task(self._run(engine), name=f"shard {start.shard_id}")
        return result

    def stop(self, stop: v1.StopShard) -> v1.CommandResult:
        engine = self.engines.get(stop.shard_id)
        if engine is None:
            return v1.CommandResult(
                command_id=stop.command_id, ok=True, error=f"shard {stop.shard_id} is not running"
            )
        grace = stop.grace.total_seconds() if stop.grace is not None else self.config.stop_grace
        self._spawn_task(engine, self._stop(engine, grace, "stopped on command"))
        return v1.CommandResult(command_id=stop.command_id, ok=True)

    def drain(self, drain: v1.DrainShard) -> v1.CommandResult:
        engine = self.engines.get(drain.shard_id)
        if engine is None:
            return v1.CommandResult(
                command_id=drain.command_id, ok=True, error=f"shard {drain.shard_id} is not running"
            )
        if engine.state != S.DRAINING and not engine.stop_reason:
            deadline = drain.deadline or _now() + datetime.timedelta(seconds=self.config.stop_grace)
            self._spawn_task(engine, self._drain(engine, deadline))
        return v1.CommandResult(command_id=drain.command_id, ok=True)

    # ---- what the node runs ----------------------------------------------------------

    def engine_command(self, adapter: Adapter | None) -> list[str]:
        if adapter is None:
            return []
        return list(getattr(self.config.engines, adapter.name).command)

    def node_view(self) -> NodeView:
        return NodeView(
            gpus=self.gpus,
            simulated=self.simulated,
            gpus_in_use={i: e.shard_id for e in self.engines.values() for i in e.start.gpu_indices},
            ports_in_use={e.start.port: e.shard_id for e in self.engines.values()},
        )

    def running_shards(self) -> list[v1.RunningShard]:
        out = []
        for engine in self.engines.values():
            if engine.state not in (S.STARTING, S.READY, S.DRAINING):
                continue
            r = engine.record
            out.append(
                v1.RunningShard(
                    shard_id=r.shard_id,
                    replica_id=r.replica_id,
                    model=r.model,
                    profile=r.profile,
                    state=engine.state,
                    endpoint_url=r.endpoint_url,
                    gpu_indices=list(r.gpu_indices),
                    port=r.port,
                    pid=r.pid,
                    rank=r.rank,
                    world_size=r.world_size,
                    started_at=datetime.datetime.fromtimestamp(r.started_at, datetime.UTC),
                )
            )
        return out

    def output_tail(self, shard_id: str) -> str:
        engine = self.engines.get(shard_id)
        return _tail(engine, self.config.output_tail_lines) if engine else ""

    # ---- adoption and shutdown -------------------------------------------------------

    def adopt(self) -> list[str]:
        """Re-adopt engines a previous agent left running; returns their shard ids.

        Records whose engine is gone are removed and reported FAILED.
        """
        adopted: list[str] = []
        for path, record in _read_records(self.state_dir):
            if record is None:
                log.warning("removing unreadable shard record", path=str(path))
                path.unlink(missing_ok=True)
                continue
            if record.shard_id in self.engines:
                continue
            start = v1.StartShard.parse(base64.b64decode(record.start_shard))
            adapter = adapter_for(start.engine)
            if adapter is None or not _record_alive(record):
                log.warning("recorded engine is gone", shard=record.shard_id, pid=record.pid)
                path.unlink(missing_ok=True)
                self._emit_for(
                    start,
                    S.FAILED,
                    reason=f"engine pid {record.pid} exited while no agent was watching it",
                    tail=_file_tail(Path(record.output_path), self.config.output_tail_lines),
                )
                continue
            launch = Launch(
                argv=record.argv,
                env=record.env,
                health_url=record.health_url,
                metrics_url=record.metrics_url,
                endpoint_url=record.endpoint_url,
                headless=record.headless,
            )
            state = S.from_string(record.state) if record.state else S.STARTING
            engine = Engine(
                start=start,
                adapter=adapter,
                launch=launch,
                record=record,
                record_path=path,
                popen=None,
                state=state,
                adopted=True,
                output=deque(maxlen=self.config.output_buffer_lines),
            )
            engine.output_offset = _refill(engine, Path(record.output_path))
            self.engines[record.shard_id] = engine
            engine.lifecycle = asyncio.create_task(
                self._run(engine), name=f"shard {record.shard_id}"
            )
            log.info("re-adopted engine", shard=record.shard_id, pid=record.pid, state=state.name)
            adopted.append(record.shard_id)
        return adopted

    async def close(self, *, stop_engines: bool) -> None:
        """Stop watching; stop the engines too only when asked (upgrades leave them running)."""
        self._closing = True
        engines = list(self.engines.values())
        if stop_engines:
            for engine in engines:
                self._spawn_task(
                    engine, self._stop(engine, self.config.stop_grace, "agent exiting")
                )
            await asyncio.gather(*(e.done.wait() for e in engines))
        for engine in engines:
            for task in [*engine.tasks, *([engine.lifecycle] if engine.lifecycle else [])]:
                task.cancel()
        for engine in engines:
            for task in [*engine.tasks, *([engine.lifecycle] if engine.lifecycle else [])]:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    # ---- internals ---------------------------------------------------------------------

    def _refuse(self, start: v1.StartShard, reason: str) -> v1.CommandResult:
        log.warning("refused shard", shard=start.shard_id, reason=reason)
        self._emit_for(start, S.FAILED, reason=reason)
        return v1.CommandResult(command_id=start.command_id, ok=False, error=reason)

    def _spawn(self, start: v1.StartShard, adapter: Adapter, launch: Launch) -> Engine:
        shards_dir = self.state_dir / "shards"
        logs_dir = self.state_dir / "logs"
        shards_dir.mkdir(parents=True, exist_ok=True)
        logs_dir.mkdir(parents=True, exist_ok=True)
        name = _safe_name(start.shard_id)
        output_path = logs_dir / f"{name}.log"
        fd = os.open(output_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        try:
            popen = subprocess.Popen(
                launch.argv,
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=subprocess.STDOUT,
                env={**os.environ, **launch.env},
                start_new_session=True,
                close_fds=True,
            )
        finally:
            os.close(fd)
        multi = start.multi_node
        timeout = (
            start.load_timeout.total_seconds() if start.load_timeout else self.config.load_timeout
        )
        record = ShardRecord(
            shard_id=start.shard_id,
            replica_id=start.replica_id,
            model=start.model,
            profile=start.profile,
            engine=adapter.name,
            pid=popen.pid,
            pid_start=process_start_ticks(popen.pid) or 0,
            argv=launch.argv,
            env=launch.env,
            started_at=time.time(),
            port=start.port,
            gpu_indices=list(start.gpu_indices),
            rank=multi.rank if multi else 0,
            world_size=max(1, multi.size) if multi else 1,
            endpoint_url=launch.endpoint_url,
            health_url=launch.health_url,
            metrics_url=launch.metrics_url,
            headless=launch.headless,
            load_timeout=float(timeout),
            state=S.STARTING.name,
            output_path=str(output_path),
            start_shard=base64.b64encode(bytes(start)).decode(),
        )
        engine = Engine(
            start=start,
            adapter=adapter,
            launch=launch,
            record=record,
            record_path=shards_dir / f"{name}.json",
            popen=popen,
            output=deque(maxlen=self.config.output_buffer_lines),
        )
        self._save(engine)
        log.info("launched engine", shard=start.shard_id, pid=popen.pid, argv=launch.argv)
        return engine

    def _save(self, engine: Engine) -> None:
        engine.record.state = engine.state.name
        tmp = engine.record_path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(engine.record))
        os.replace(tmp, engine.record_path)

    def _spawn_task(self, engine: Engine, coro: object) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro)  # type: ignore[arg-type]
        engine.tasks.add(task)
        task.add_done_callback(engine.tasks.discard)

    def _emit_for(
        self, start: v1.StartShard, state: v1.ShardState, *, reason: str = "", tail: str = ""
    ) -> None:
        self.sink(
            v1.ShardStatus(
                shard_id=start.shard_id,
                replica_id=start.replica_id,
                state=state,
                reason=reason,
                output_tail=tail,
                time=_now(),
            )
        )

    def _emit(self, engine: Engine, state: v1.ShardState, *, reason: str = "") -> None:
        engine.state = state
        status = v1.ShardStatus(
            shard_id=engine.shard_id,
            replica_id=engine.start.replica_id,
            state=state,
            reason=reason,
            endpoint_url=engine.launch.endpoint_url if state == S.READY else "",
            time=_now(),
            pid=engine.pid,
            port=engine.start.port,
            gpu_indices=list(engine.start.gpu_indices),
        )
        if state in (S.FAILED, S.STOPPED):
            status.exit_code = engine.exit_code
            status.signal = engine.exit_signal
        if state == S.FAILED:
            status.output_tail = _tail(engine, self.config.output_tail_lines)
        log.info("shard transition", shard=engine.shard_id, state=state.name, reason=reason)
        self.sink(status)

    async def _run(self, engine: Engine) -> None:
        """Watch one engine from launch (or adoption) to its exit, then report the end."""
        tailer = asyncio.create_task(self._tail_output(engine))
        health = (
            asyncio.create_task(self._await_ready(engine)) if engine.state == S.STARTING else None
        )
        try:
            await self._wait_exit(engine)
        finally:
            if health is not None:
                health.cancel()
            tailer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await tailer
        if self._closing and not engine.stop_reason:
            return  # the agent is going away; the next one re-adopts this engine
        self._finish(engine)

    def _finish(self, engine: Engine) -> None:
        # Children the engine left in its group would hold GPU memory: they go too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(engine.pid, signal.SIGKILL)
        how = self._exit_text(engine)
        if engine.stop_reason and not engine.fail_reason:
            self._emit(engine, S.STOPPED, reason=f"{engine.stop_reason} ({how})")
        else:
            reason = engine.fail_reason or f"engine exited by itself: {how}"
            self._emit(engine, S.FAILED, reason=reason)
        engine.record_path.unlink(missing_ok=True)
        if self.engines.get(engine.shard_id) is engine:
            del self.engines[engine.shard_id]
        engine.done.set()

    def _exit_text(self, engine: Engine) -> str:
        if engine.exit_signal is not None:
            return f"killed by {_signal_name(engine.exit_signal)}"
        if engine.exit_code is not None:
            return f"exit code {engine.exit_code}"
        return "exit code unknown (started by a previous agent, so not this agent's child)"

    async def _wait_exit(self, engine: Engine) -> None:
        loop = asyncio.get_running_loop()
        fd = -1
        with contextlib.suppress(OSError, AttributeError):
            fd = os.pidfd_open(engine.pid)
        exited = asyncio.Event()
        if fd >= 0:
            # The pidfd turns readable when the process ends: no polling while it runs.
            loop.add_reader(fd, exited.set)
        try:
            while not self._has_exited(engine):
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5 if fd < 0 else 5.0):
                        await exited.wait()
        finally:
            if fd >= 0:
                loop.remove_reader(fd)
                os.close(fd)
        engine.exited.set()

    def _has_exited(self, engine: Engine) -> bool:
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

    async def _await_ready(self, engine: Engine) -> None:
        deadline = engine.record.started_at + engine.record.load_timeout
        interval = self.config.health_interval
        while True:
            if engine.launch.headless:
                # A headless rank serves no HTTP: alive after one interval counts as ready.
                await asyncio.sleep(interval)
                if not engine.exited.is_set():
                    break
                return
            try:
                status, _ = await http_get(engine.launch.health_url, timeout=max(interval, 2.0))
            except (OSError, TimeoutError):
                status = 0
            if status == 200:
                break
            if time.time() >= deadline:
                engine.fail_reason = (
                    f"not ready within the load timeout of {engine.record.load_timeout:g}s "
                    f"(last health check: {status or 'no answer'})"
                )
                await self._terminate(engine, self.config.stop_grace)
                return
            await asyncio.sleep(interval)
        if engine.stop_reason or engine.exited.is_set():
            return
        self._emit(engine, S.READY, reason="health check passed")
        self._save(engine)

    async def _drain(self, engine: Engine, deadline: datetime.datetime) -> None:
        serving = engine.state == S.READY and not engine.launch.headless
        self._emit(engine, S.DRAINING, reason="draining running requests")
        self._save(engine)
        running: float | None = None
        while not engine.exited.is_set() and not engine.stop_reason:
            if not serving:
                break  # still loading, or a headless rank: no requests of its own
            running = await self._running_requests(engine)
            if running == 0 or _now() >= deadline:
                break
            await asyncio.sleep(self.config.drain_poll_interval)
        if running:
            why = f"drained: deadline passed with {running:g} requests running"
        else:
            why = "drained"
        await self._stop(engine, self.config.stop_grace, why)

    async def _running_requests(self, engine: Engine) -> float | None:
        try:
            status, body = await http_get(engine.launch.metrics_url, timeout=5.0)
        except (OSError, TimeoutError):
            return None
        if status != 200:
            return None
        return metric_value(body.decode(errors="replace"), engine.adapter.running_metric)

    async def _stop(self, engine: Engine, grace: float, reason: str) -> None:
        if not engine.stop_reason:
            engine.stop_reason = reason
        await self._terminate(engine, grace)
        await engine.done.wait()

    async def _terminate(self, engine: Engine, grace: float) -> None:
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

    async def _tail_output(self, engine: Engine) -> None:
        """Follow the engine's output file into the ring buffer and the agent's log."""
        path = Path(engine.record.output_path)
        offset = engine.output_offset
        partial = b""
        try:
            while True:
                offset, partial = self._read_more(engine, path, offset, partial)
                await asyncio.sleep(0.2)
        finally:
            # Whatever the engine wrote last (often why it died) makes the tail.
            self._read_more(engine, path, offset, partial, final=True)

    def _read_more(
        self, engine: Engine, path: Path, offset: int, partial: bytes, *, final: bool = False
    ) -> tuple[int, bytes]:
        try:
            size = path.stat().st_size
            if size < offset:
                offset = 0  # truncated
            if size == offset and not (final and partial):
                return offset, partial
            with path.open("rb") as f:
                f.seek(offset)
                data = f.read(size - offset)
        except OSError:
            return offset, partial
        offset += len(data)
        data = partial + data
        lines = data.split(b"\n")
        partial = lines.pop()
        if final and partial:
            lines.append(partial)
            partial = b""
        for raw in lines:
            line = raw.decode(errors="replace").rstrip("\r")
            engine.output.append(line)
            engine_log.info(line, shard=engine.shard_id)
        if offset > self.config.output_file_max_bytes:
            # The engine appends (O_APPEND), so after truncation it writes at the new end.
            # Lines written between the read and the truncation are lost; the tail survives.
            with contextlib.suppress(OSError):
                os.truncate(path, 0)
                offset = 0
        return offset, partial


def _refill(engine: Engine, path: Path) -> int:
    """Fill an adopted engine's ring buffer from the end of its file; the offset to follow."""
    try:
        size = path.stat().st_size
        start = max(0, size - 64 * 1024)
        with path.open("rb") as f:
            f.seek(start)
            recent = f.read(size - start).decode(errors="replace").splitlines()
    except OSError:
        return 0
    # A read that starts mid-file starts mid-line: drop that first fragment.
    engine.output.extend(recent[1:] if start else recent)
    return size


def _tail(engine: Engine, lines: int) -> str:
    return "\n".join(list(engine.output)[-lines:])


def _file_tail(path: Path, lines: int) -> str:
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - 64 * 1024))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
