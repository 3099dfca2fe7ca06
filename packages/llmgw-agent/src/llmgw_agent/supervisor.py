"""The lifecycle of engine processes: launch, health, drain, stop, exit, re-adoption.

Each engine runs in its own session (so its own process group) and writes its output
to a file in the state directory (:mod:`llmgw_agent.output`). Every running shard has one
record (:mod:`llmgw_agent.records`); a new agent re-adopts the engines whose pid is alive
with the same start time and command line (:mod:`llmgw_agent.procs`), and supervises them
by pid. What to launch is decided by :func:`llmgw_agent.plan.plan`, nowhere else.

Every engine is also marked in its environment with its shard and this agent's state
directory. A marked engine that no readable record names (a record torn by a crash, or
lost) is a stray: it is stopped by process group (SIGTERM, SIGKILL after the stop grace),
and its port and GPUs stay taken until it is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import hashlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from urllib.parse import urlsplit

import structlog
from llmgw_proto import tracing, v1

from llmgw_agent import serving
from llmgw_agent.adapters import (
    adapter_for,
    api_key_options,
    new_api_key,
    redacted_argv,
    with_api_key,
    with_kv_endpoint,
)
from llmgw_agent.config import AgentConfig
from llmgw_agent.disagg import rdma_devices
from llmgw_agent.engine_process import (
    Engine,
    exit_text,
    now,
    own_polls,
    terminate,
    wait_exit,
)
from llmgw_agent.engines import InstalledEngine, load_installed
from llmgw_agent.health import health_status, running_requests
from llmgw_agent.kv_events import KvSource
from llmgw_agent.load import LoadSource
from llmgw_agent.lora import EngineTarget
from llmgw_agent.output import OutputFollower, file_tail
from llmgw_agent.plan import Plan, Refused, plan
from llmgw_agent.procs import (
    Marked,
    cmdline_matches,
    marked_processes,
    marks,
    process_start_ticks,
    stop_group,
)
from llmgw_agent.records import (
    FILE_MODE,
    ShardRecord,
    live_records,
    private_dir,
    read_records,
    record_path,
    remove_leftovers,
    write_private,
)
from llmgw_agent.validation import NodeView, Probes, real_probes

__all__ = [
    "Engine",
    "ShardRecord",
    "Supervisor",
    "cmdline_matches",
    "live_records",
    "process_start_ticks",
]

log = structlog.get_logger(__name__)

StatusSink = Callable[[v1.ShardStatus], None]
S = v1.ShardState


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
        engines: Mapping[str, InstalledEngine] | None = None,
        gpu_memory: Callable[[], Mapping[int, tuple[int, int]]] | None = None,
    ) -> None:
        self.config = config
        self.gpus = gpus
        self.simulated = simulated
        self.sink = sink
        self.probes = probes or real_probes()
        self.state_dir = Path(config.state_dir).expanduser()
        self.engines: dict[str, Engine] = {}
        self._installed = dict(engines) if engines is not None else None
        self._gpu_memory = gpu_memory
        self._closing = False
        # Who marks its engines as its own: the state directory holds their records.
        self.identity = str(self.state_dir.resolve())
        # Engines of this agent that no record names, by process group, being stopped.
        self.strays: dict[int, list[Marked]] = {}
        self._stray_tasks: set[asyncio.Task[None]] = set()

    # ---- the engines installed ---------------------------------------------------------

    def installed(self) -> dict[str, InstalledEngine]:
        """Each engine kind's version and flags, read once (the first call may take long)."""
        if self._installed is None:
            self._installed = load_installed(self.config, self.state_dir)
        return self._installed

    # ---- commands -------------------------------------------------------------------

    def start(self, start: v1.StartShard) -> v1.CommandResult:
        """Validate and launch; returns at once (loading is watched in the background)."""
        with serving.start_span(start):
            return self._start(start)

    def _start(self, start: v1.StartShard) -> v1.CommandResult:
        result = v1.CommandResult(command_id=start.command_id, ok=True)
        if start.shard_id in self.engines:
            result.error = (
                f"shard {start.shard_id} already runs (pid {self.engines[start.shard_id].pid})"
            )
            return result
        self._emit_for(start, S.VALIDATING, reason="checking the profile before launch")
        view = self.node_view()
        with tracing.span("agent.validate"):
            decided = plan(start, self.config, view, self.probes)
        if isinstance(decided, Refused):
            # A port another program holds (not a shard of this agent) is named apart,
            # so control places the retry on another one instead of this one again.
            taken = (
                [start.port]
                if 0 < start.port < 65536
                and start.port not in view.ports_in_use
                and not self.probes.port_free(self.config.engine_host, start.port)
                else []
            )
            return self._refuse(
                start, "validation failed: " + "; ".join(decided.problems), ports_taken=taken
            )
        try:
            with tracing.span("agent.launch"):
                engine = self._spawn(decided)
        except OSError as err:
            return self._refuse(start, f"could not launch {decided.launch.argv[0]!r}: {err}")
        self.engines[start.shard_id] = engine
        serving.launched(start.shard_id)
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
            deadline = drain.deadline or now() + datetime.timedelta(seconds=self.config.stop_grace)
            self._spawn_task(engine, self._drain(engine, deadline))
        return v1.CommandResult(command_id=drain.command_id, ok=True)

    # ---- what the node runs ----------------------------------------------------------

    def node_view(self) -> NodeView:
        gpus_in_use = {i: e.shard_id for e in self.engines.values() for i in e.start.gpu_indices}
        ports_in_use = {e.start.port: e.shard_id for e in self.engines.values()}
        for members in self.strays.values():
            owner = f"{members[0].shard_id} (a stray engine, being stopped)"
            for m in members:
                gpus_in_use.update(dict.fromkeys(m.gpus, owner))
                if m.port:
                    ports_in_use[m.port] = owner
        return NodeView(
            gpus=self.gpus,
            simulated=self.simulated,
            gpus_in_use=gpus_in_use,
            ports_in_use=ports_in_use,
            engines=self.installed(),
            gpu_memory=self._gpu_memory() if self._gpu_memory else {},
            rdma_devices=rdma_devices(),
        )

    def running_shards(self) -> list[v1.RunningShard]:
        out = []
        for engine in self.engines.values():
            if engine.state not in (S.STARTING, S.READY, S.DRAINING):
                continue
            start, multi = engine.start, engine.start.multi_node
            out.append(
                v1.RunningShard(
                    shard_id=start.shard_id,
                    replica_id=start.replica_id,
                    model=start.model,
                    profile=start.profile,
                    state=engine.state,
                    endpoint_url=engine.record.launch.endpoint_url,
                    gpu_indices=list(start.gpu_indices),
                    port=start.port,
                    pid=engine.pid,
                    api_key=engine.record.launch.api_key,
                    routes=serving.routes_of(start.shard_id),
                    rank=multi.rank if multi else 0,
                    world_size=max(1, multi.size) if multi else 1,
                    started_at=datetime.datetime.fromtimestamp(
                        engine.record.started_at, datetime.UTC
                    ),
                )
            )
        return out

    def load_sources(self) -> list[LoadSource]:
        """The engines whose load is worth reading: serving ones, with HTTP of their own."""
        return [
            LoadSource(
                shard_id=e.shard_id,
                metrics_url=e.record.launch.metrics_url,
                metrics=e.adapter.load,
                # The launch time (ms): a restarted engine is a new generation.
                generation=int(e.record.started_at * 1000),
                api_key=e.record.launch.api_key,
            )
            for e in self.engines.values()
            if e.state in (S.READY, S.DRAINING) and not e.record.launch.headless
        ]

    def adapter_target(self, shard_id: str) -> EngineTarget | None:
        """A serving engine's address for LoRA adapter commands (llmgw_agent.lora)."""
        e = self.engines.get(shard_id)
        if e is None or e.state not in (S.READY, S.DRAINING) or e.record.launch.headless:
            return None
        parts = urlsplit(e.record.launch.health_url)
        return EngineTarget(
            kind=e.adapter.kind,
            base_url=f"{parts.scheme}://{parts.netloc}",
            api_key=e.record.launch.api_key,
            generation=int(e.record.started_at * 1000),
        )

    def kv_sources(self) -> list[KvSource]:
        """The serving engines that publish KV-cache events."""
        return [
            KvSource(
                shard_id=e.shard_id,
                endpoint=e.record.launch.kv_events_endpoint,
                topic=e.record.launch.kv_events_topic,
                generation=int(e.record.started_at * 1000),
            )
            for e in self.engines.values()
            if e.state in (S.READY, S.DRAINING) and e.record.launch.kv_events_endpoint
        ]

    def output_tail(self, shard_id: str) -> str:
        engine = self.engines.get(shard_id)
        return engine.output.tail(self.config.output_tail_lines) if engine else ""

    # ---- adoption and shutdown -------------------------------------------------------

    def adopt(self) -> list[str]:
        """Re-adopt engines a previous agent left running; returns their shard ids.

        Records whose engine is gone are removed and reported FAILED. Marked engines
        no readable record names are strays: stopped (see :meth:`stop_strays`).
        """
        adopted: list[str] = []
        for leftover in remove_leftovers(self.state_dir):
            log.warning("removed the temporary file of an interrupted write", path=str(leftover))
        for path, record in read_records(self.state_dir):
            if record is None:
                log.warning(
                    "removing unreadable shard record (torn or corrupt); its engine, if it "
                    "still runs, is found by its mark and stopped",
                    path=str(path),
                )
                path.unlink(missing_ok=True)
                continue
            if record.shard_id in self.engines:
                continue
            adapter = adapter_for(record.start.engine)
            if adapter is None or not record.alive():
                log.warning("recorded engine is gone", shard=record.shard_id, pid=record.pid)
                path.unlink(missing_ok=True)
                self._emit_for(
                    record.start,
                    S.FAILED,
                    reason=f"engine pid {record.pid} exited while no agent was watching it",
                    tail=file_tail(
                        Path(record.output_path),
                        self.config.output_tail_lines,
                        own_polls(record.launch),
                        record.launch.api_key,
                    ),
                )
                continue
            state = S.from_string(record.state) if record.state else S.STARTING
            engine = Engine(
                record=record,
                adapter=adapter,
                path=path,
                output=self._follower(record),
                popen=None,
                state=state,
                adopted=True,
            )
            engine.output.refill()
            self.engines[record.shard_id] = engine
            engine.lifecycle = asyncio.create_task(
                self._run(engine), name=f"shard {record.shard_id}"
            )
            log.info("re-adopted engine", shard=record.shard_id, pid=record.pid, state=state.name)
            adopted.append(record.shard_id)
        self._find_strays()
        return adopted

    def _find_strays(self) -> None:
        """Stop this agent's marked engines that no record names; their holdings stay taken."""
        groups: dict[int, list[Marked]] = {}
        for m in marked_processes(self.identity):
            if m.shard_id not in self.engines and m.pgid > 1 and m.pgid != os.getpgrp():
                groups.setdefault(m.pgid, []).append(m)
        for pgid, members in groups.items():
            if pgid in self.strays:
                continue
            log.warning(
                "stopping an engine no record names (its record was torn or lost)",
                shard=members[0].shard_id,
                pgid=pgid,
                pids=[m.pid for m in members],
                port=members[0].port,
            )
            self.strays[pgid] = members
            task = asyncio.create_task(self._stop_stray(pgid, members), name=f"stray {pgid}")
            self._stray_tasks.add(task)
            task.add_done_callback(self._stray_tasks.discard)

    async def _stop_stray(self, pgid: int, members: list[Marked]) -> None:
        try:
            clean = await stop_group(pgid, members, self.config.stop_grace)
            log.info("stray engine stopped", shard=members[0].shard_id, pgid=pgid, clean=clean)
        finally:
            self.strays.pop(pgid, None)

    async def stop_strays(self) -> None:
        """Until every stray found at adoption is gone (or given up on)."""
        while self._stray_tasks:
            await asyncio.gather(*self._stray_tasks, return_exceptions=True)

    async def close(self, *, stop_engines: bool) -> None:
        """Stop watching; stop the engines too only when asked (upgrades leave them running)."""
        self._closing = True
        await self.stop_strays()
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

    def _follower(self, record: ShardRecord) -> OutputFollower:
        return OutputFollower(
            Path(record.output_path),
            record.shard_id,
            lines=self.config.output_buffer_lines,
            max_bytes=self.config.output_file_max_bytes,
            skip=own_polls(record.launch),
            secret=record.launch.api_key,
        )

    def _refuse(
        self, start: v1.StartShard, reason: str, *, ports_taken: list[int] | None = None
    ) -> v1.CommandResult:
        log.warning("refused shard", shard=start.shard_id, reason=reason)
        self._emit_for(start, S.FAILED, reason=reason, ports_taken=ports_taken)
        return v1.CommandResult(command_id=start.command_id, ok=False, error=reason)

    def _spawn(self, decided: Plan) -> Engine:
        start, launch = decided.start, decided.launch
        if launch.kv_events_endpoint:
            # KV events carry the token ids of every cached prompt: published on a Unix
            # socket of this agent's (vLLM and SGLang bind an ipc:// endpoint; a tcp://
            # one they bind only as a wildcard, every address of the node), one per
            # engine, persisted with the launch so a re-adoption finds it.
            launch = with_kv_endpoint(launch, self._kv_socket(start.shard_id))
            decided = dataclasses.replace(decided, launch=launch)
        # A fresh secret per launch: the engine's port refuses whoever lacks it, so only
        # routers (given it through the control plane) and this agent reach the engine.
        path = record_path(self.state_dir, start.shard_id)
        # Records hold the profile's env (tokens) and logs may echo it: owner only.
        private_dir(path.parent)
        # SGLang reads the key from an options file beside the record, not from argv.
        options = path.with_name(path.stem + ".options.yaml")
        key = new_api_key()
        launch = with_api_key(decided.adapter, launch, key, str(options))
        decided = dataclasses.replace(decided, launch=launch)
        if launch.api_key_file:
            write_private(options, api_key_options(key))
        logs_dir = private_dir(self.state_dir / "logs")
        output_path = logs_dir / path.with_suffix(".log").name
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND
        fd = os.open(output_path, flags, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)  # a log left by an older agent keeps its mode otherwise
            mark = marks(start.shard_id, self.identity, start.port, start.gpu_indices)
            popen = subprocess.Popen(
                launch.argv,
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=subprocess.STDOUT,
                env={**os.environ, **launch.env, **mark},
                start_new_session=True,
                close_fds=True,
            )
        finally:
            os.close(fd)
        record = ShardRecord(
            start_shard=ShardRecord.encode_start(start),
            launch=launch,
            pid=popen.pid,
            pid_start=process_start_ticks(popen.pid) or 0,
            started_at=time.time(),
            load_timeout=decided.load_timeout,
            output_path=str(output_path),
        )
        engine = Engine(
            record=record,
            adapter=decided.adapter,
            path=path,
            output=self._follower(record),
            popen=popen,
        )
        engine.save()
        log.info("launched engine", shard=start.shard_id, pid=popen.pid, argv=redacted_argv(launch))
        if launch.endpoint_warning:
            log.warning(
                "engine unreachable at its endpoint URL",
                shard=start.shard_id,
                endpoint=launch.endpoint_url,
                problem=launch.endpoint_warning,
            )
        return engine

    def _kv_socket(self, shard_id: str) -> str:
        """``ipc://`` path for one engine's KV events, in a directory only we can enter."""
        name = record_path(self.state_dir, shard_id).with_suffix(".kv").name
        where = self.state_dir / "kv"
        if len(str(where / name)) > 100:  # a Unix socket path holds about 107 bytes
            digest = hashlib.blake2b(f"{self.state_dir}/{shard_id}".encode(), digest_size=8)
            where = Path(tempfile.gettempdir()) / f"llmgw-agent-{os.getuid()}"
            name = digest.hexdigest() + ".kv"
        where.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(where, 0o700)
        return f"ipc://{where / name}"

    def _spawn_task(self, engine: Engine, coro: object) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro)  # type: ignore[arg-type]
        engine.tasks.add(task)
        task.add_done_callback(engine.tasks.discard)

    def _emit_for(
        self,
        start: v1.StartShard,
        state: v1.ShardState,
        *,
        reason: str = "",
        tail: str = "",
        ports_taken: list[int] | None = None,
    ) -> None:
        self.sink(
            serving.stamp(
                v1.ShardStatus(
                    shard_id=start.shard_id,
                    replica_id=start.replica_id,
                    state=state,
                    reason=reason,
                    output_tail=tail,
                    time=now(),
                    ports_taken=ports_taken or [],
                )
            )
        )

    def _emit(self, engine: Engine, state: v1.ShardState, *, reason: str = "") -> None:
        status = engine.transition(state, reason, tail_lines=self.config.output_tail_lines)
        log.info("shard transition", shard=engine.shard_id, state=state.name, reason=status.reason)
        self.sink(serving.stamp(status))

    async def _run(self, engine: Engine) -> None:
        """Watch one engine from launch (or adoption) to its exit, then report the end."""
        follower = asyncio.create_task(engine.output.follow())
        health = (
            asyncio.create_task(self._await_ready(engine)) if engine.state == S.STARTING else None
        )
        try:
            await wait_exit(engine)
        finally:
            if health is not None:
                health.cancel()
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower
        if self._closing and not engine.stop_reason:
            return  # the agent is going away; the next one re-adopts this engine
        self._finish(engine)

    def _finish(self, engine: Engine) -> None:
        # Children the engine left in its group would hold GPU memory: they go too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(engine.pid, signal.SIGKILL)
        how = exit_text(engine)
        serving.load_done(engine.shard_id, engine.record.started_at, f"exited: {how}")
        if engine.stop_reason and not engine.fail_reason:
            self._emit(engine, S.STOPPED, reason=f"{engine.stop_reason} ({how})")
        else:
            reason = engine.fail_reason or f"engine exited by itself: {how}"
            self._emit(engine, S.FAILED, reason=reason)
        engine.path.unlink(missing_ok=True)
        if engine.record.launch.api_key_file:
            Path(engine.record.launch.api_key_file).unlink(missing_ok=True)
        serving.forget(engine.shard_id)
        if self.engines.get(engine.shard_id) is engine:
            del self.engines[engine.shard_id]
        engine.done.set()

    async def _await_ready(self, engine: Engine) -> None:
        record = engine.record
        deadline = record.started_at + record.load_timeout
        interval = self.config.health_interval
        while True:
            if record.launch.headless:
                # A headless rank serves no HTTP: alive after one interval counts as ready.
                await asyncio.sleep(interval)
                if not engine.exited.is_set():
                    break
                return
            status = await health_status(
                record.launch.health_url,
                timeout=max(interval, 2.0),
                api_key=record.launch.api_key,
            )
            if status == 200:
                break
            if time.time() >= deadline:
                engine.fail_reason = (
                    f"not ready within the load timeout of {record.load_timeout:g}s "
                    f"(last health check: {status or 'no answer'})"
                )
                await terminate(engine, self.config.stop_grace)
                return
            await asyncio.sleep(interval)
        if engine.stop_reason or engine.exited.is_set():
            return
        launch = record.launch
        routes = await serving.read_routes(engine.start.engine, launch.health_url, launch.api_key)
        serving.remember_routes(engine.shard_id, routes)
        serving.load_done(engine.shard_id, record.started_at, "ready")
        self._emit(engine, S.READY, reason="health check passed")
        engine.save()

    async def _drain(self, engine: Engine, deadline: datetime.datetime) -> None:
        launch = engine.record.launch
        serving = engine.state == S.READY and not launch.headless
        self._emit(engine, S.DRAINING, reason="draining running requests")
        engine.save()
        running: float | None = None
        while not engine.exited.is_set() and not engine.stop_reason:
            if not serving:
                break  # still loading, or a headless rank: no requests of its own
            running = await running_requests(
                launch.metrics_url, engine.adapter.running_metric, launch.api_key
            )
            if running == 0 or now() >= deadline:
                break
            await asyncio.sleep(self.config.drain_poll_interval)
        if running:
            why = f"drained: deadline passed with {running:g} requests running"
        else:
            why = "drained"
        await self._stop(engine, self.config.stop_grace, why)

    async def _stop(self, engine: Engine, grace: float, reason: str) -> None:
        if not engine.stop_reason:
            engine.stop_reason = reason
        await terminate(engine, grace)
        await engine.done.wait()
