"""The supervisor: forks the workers, watches them, starts dead ones again, drains
them on SIGTERM; and `run_router`, which runs it, or for `workers: 1` the router alone.

The router itself (server.py) is imported here only to run it: in a forked worker,
or in the one process of `workers: 1`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

import structlog
from llmgw_proto.addr import parse_hostport

from llmgw_router.config import ApiKey, RouterConfig
from llmgw_router.endpoints import EndpointSpec
from llmgw_router.workers.fleet_admin import fleet_admin_app
from llmgw_router.workers.merge import MetricsMerger
from llmgw_router.workers.slots import Forked, Slot
from llmgw_router.workers.worker import WorkerContext, reuseport_socket, worker_count

__all__ = ["Supervisor", "run_router"]

log = structlog.get_logger(__name__)


def _die_with_parent() -> None:
    """SIGTERM (drain, then exit) when the supervisor dies, however it dies."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)


def _worker_child(supervisor: Supervisor, context: WorkerContext, inherited: list[Any]) -> None:
    """In the forked child: drop what belongs to the supervisor, run one router, exit."""
    code = 0
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        for sock in inherited:
            # Detached first, so that the object can never close that number again
            # once it belongs to one of this worker's own sockets.
            raw = getattr(sock, "_sock", sock)  # asyncio's TransportSocket wraps one
            with contextlib.suppress(OSError):
                os.close(raw.detach())
        _die_with_parent()
        if os.getppid() != supervisor.pid:
            os._exit(1)  # the supervisor died before we asked to follow it
        structlog.contextvars.bind_contextvars(worker=context.index)
        from llmgw_router.server import run

        run(
            supervisor.config,
            supervisor.static,
            insecure=supervisor.insecure,
            api_keys=supervisor.api_keys,
            worker=context,
        )
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else 1
    except BaseException:  # the worker's last word, then out
        log.exception("worker failed", worker=context.index)
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


# ---------------------------------------------------------------- the supervisor


class Supervisor:
    def __init__(
        self,
        config: RouterConfig,
        static: tuple[EndpointSpec, ...],
        *,
        workers: int,
        insecure: bool,
        api_keys: tuple[ApiKey, ...],
        log_level: str,
        log_format: str,
    ) -> None:
        self.config = config
        self.static = static
        self.workers = workers
        self.insecure = insecure
        self.api_keys = api_keys
        self.log_level = log_level
        self.log_format = log_format
        self.runtime_dir = tempfile.mkdtemp(prefix="llmgw-router-")
        self.slots = [Slot(i) for i in range(workers)]
        self.stopping = False
        self.ever_up = False
        self.all_ready_once = False
        self.metrics = MetricsMerger()
        self.failed = False
        self.pid = os.getpid()
        self._sessions: dict[int, Any] = {}
        # Sockets of the supervisor's own that a forked worker closes at once.
        self._inherited: list[Any] = []

    # -- workers

    def _context(self, index: int) -> WorkerContext:
        return WorkerContext(index, self.workers, self.runtime_dir)

    def _spawn(self, slot: Slot) -> None:
        context = self._context(slot.index)
        for path in (context.admin_socket, context.peer_socket):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        # Forked, not a new interpreter: every module is imported already (see
        # run_router), so a worker starts (and a dead one is replaced) in milliseconds
        # rather than seconds of imports, and shares the supervisor's pages.
        pid = os.fork()
        if pid == 0:
            _worker_child(self, context, self._inherited)
        slot.proc = Forked(pid)
        slot.up = False
        slot.started_at = time.monotonic()
        log.info("worker started", worker=slot.index, pid=pid)

    def session(self, slot: Slot) -> Any:
        import aiohttp

        session = self._sessions.get(slot.index)
        if session is None or session.closed:
            connector = aiohttp.UnixConnector(path=self._context(slot.index).admin_socket)
            session = aiohttp.ClientSession(connector=connector)
            self._sessions[slot.index] = session
        return session

    async def get(self, slot: Slot, path: str, timeout: float = 5.0) -> tuple[int, bytes, str]:
        """GET ``path`` from a worker's own admin app: status, body, content type."""
        import aiohttp

        session = self.session(slot)
        async with session.get(
            "http://worker" + path, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            return resp.status, await resp.read(), resp.headers.get("content-type", "")

    async def fan_out(self, path: str) -> list[tuple[Slot, int, bytes, str]]:
        live = [s for s in self.slots if s.up and s.proc is not None and s.proc.poll() is None]

        async def one(slot: Slot) -> tuple[Slot, int, bytes, str] | None:
            try:
                status, body, kind = await self.get(slot, path)
            except Exception:  # a worker going away: OSError, timeouts, aiohttp's errors
                return None
            return slot, status, body, kind

        results = await asyncio.gather(*(one(s) for s in live))
        return [r for r in results if r is not None]

    async def _probe_up(self, slot: Slot) -> None:
        with contextlib.suppress(Exception):
            status, _, _ = await self.get(slot, "/healthz", timeout=1.0)
            if status == 200 and not slot.up:
                slot.up = True
                self.ever_up = True
                log.info("worker up", worker=slot.index, pid=slot.proc.pid if slot.proc else 0)

    async def _supervise(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            now = time.monotonic()
            for slot in self.slots:
                proc = slot.proc
                if proc is None:
                    if not self.stopping and now >= slot.restart_at:
                        slot.restarts += 1
                        self._spawn(slot)
                    continue
                code = proc.poll()
                if code is None:
                    if not slot.up:
                        await self._probe_up(slot)
                    continue
                self.metrics.retire(proc.pid)
                slot.proc = None
                slot.history.append(code)
                if self.stopping:
                    continue
                lived = now - slot.started_at
                how = f"signal {-code}" if code < 0 else f"exit code {code}"
                if not slot.up and not self.ever_up:
                    log.error("worker failed to start; stopping", worker=slot.index, status=how)
                    self.failed = True
                    stop.set()
                    break
                slot.attempt = 0 if lived > 30 else slot.attempt + 1
                delay = 0.0 if slot.attempt <= 1 else min(30.0, 0.5 * 2 ** (slot.attempt - 2))
                slot.restart_at = now + delay
                log.warning(
                    "worker died; starting another",
                    worker=slot.index,
                    pid=proc.pid,
                    status=how,
                    lived=round(lived, 3),
                    restart_in=delay,
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)

    def _signal_all(self, sig: int) -> None:
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot.proc.pid, sig)

    async def _drain(self) -> None:
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.config.shutdown_grace + 10.0
        while time.monotonic() < deadline:
            if all(s.proc is None or s.proc.poll() is not None for s in self.slots):
                break
            await asyncio.sleep(0.05)
        else:
            log.warning("workers still running after the grace period; killing them")
            self._signal_all(signal.SIGKILL)
        for slot in self.slots:
            if slot.proc is not None:
                code = slot.proc.wait()
                slot.history.append(code)
                if code != 0:
                    self.failed = True
                slot.proc = None

    # -- running

    async def run(self) -> int:
        from aiohttp import web

        try:
            # First without SO_REUSEPORT: a port some other process (or another
            # multi-worker router) holds must be an error here, not a shared port.
            reuseport_socket(self.config.listen, listen=False, reuse_port=False).close()
            reserved = reuseport_socket(self.config.listen, listen=False)
        except OSError as err:
            log.error("cannot bind the listen address", listen=self.config.listen, error=str(err))
            return 1
        runner = web.AppRunner(fleet_admin_app(self), access_log=None, handle_signals=False)
        await runner.setup()
        host, port = parse_hostport(
            self.config.admin_listen, default_host="0.0.0.0", allow_port_zero=True
        )
        self._inherited.append(reserved)
        try:
            site = web.TCPSite(runner, host, port, backlog=128)
            await site.start()
            server = getattr(site, "_server", None)
            self._inherited += list(getattr(server, "sockets", None) or ())
        except OSError as err:
            log.error(
                "cannot bind the admin address",
                admin_listen=self.config.admin_listen,
                error=str(err),
            )
            await runner.cleanup()
            reserved.close()
            return 1
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._signal_all, signal.SIGHUP)
        log.info(
            "router starting",
            workers=self.workers,
            listen=self.config.listen,
            admin_listen=self.config.admin_listen,
            pid=os.getpid(),
        )
        for slot in self.slots:
            self._spawn(slot)
        try:
            await self._supervise(stop)
            self.stopping = True
            log.info("shutting down", workers=self.workers, grace=self.config.shutdown_grace)
            await self._drain()
        finally:
            self.stopping = True
            self._signal_all(signal.SIGKILL)
            for session in self._sessions.values():
                await session.close()
            await runner.cleanup()
            reserved.close()
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
        if self.failed:
            return 1
        log.info("router stopped")
        return 0


def run_router(
    config: RouterConfig,
    static: tuple[EndpointSpec, ...],
    *,
    insecure: bool = False,
    api_keys: tuple[ApiKey, ...] = (),
    log_level: str = "info",
    log_format: str = "auto",
) -> None:
    """`llmgw-router serve`: one process for `workers: 1`, else a supervisor and N workers."""
    n = worker_count(config)
    if n == 1:
        from llmgw_router.server import run

        run(config, static, insecure=insecure, api_keys=api_keys)
        return
    # Imported before any worker is forked, so that none imports anything.
    import llmgw_router.server

    if config.control is not None:
        import llmgw_router.control.watch  # noqa: F401
    supervisor = Supervisor(
        config,
        static,
        workers=n,
        insecure=insecure,
        api_keys=api_keys,
        log_level=log_level,
        log_format=log_format,
    )
    code = asyncio.run(supervisor.run())
    if code:
        raise SystemExit(code)
