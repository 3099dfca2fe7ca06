"""`workers: N`: N router processes on one listening port, under a supervisor.

With ``workers: 1`` none of this runs: the router is one process, as it always was.
With more, the process started as `llmgw-router serve` becomes the supervisor:

- Each worker is forked from the supervisor, which imports everything first (so a
  worker starts in milliseconds), and runs the whole router of :mod:`llmgw_router.server`
  (event loop, balancer, upstream pool, health checks, its own Watch subscription),
  with its own socket on the listen address (``SO_REUSEPORT``: the kernel spreads
  new connections over the workers' sockets, and nobody shares an accept queue).
  The supervisor binds the address too, without listening, so a port in use is
  reported once and clearly, and the port stays ours while workers restart.
- Why every worker subscribes on its own rather than the supervisor feeding them: a
  worker is then exactly the router that `workers: 1` runs (snapshots, load figures
  and whatever router-side state comes with them need no second transport), a hung
  or restarting supervisor cannot stall the endpoint set, and the control plane is
  built for many routers (N workers cost it N streams, the same as N routers).
- What must agree is shared: the endpoint snapshot comes from the same control plane
  to every worker; an ejection one worker makes is sent at once to the others (a
  datagram per peer over Unix sockets in the supervisor's private runtime
  directory), so an endpoint that one worker saw fail is not hammered by the rest;
  API keys come from the same config and keys file (SIGHUP re-reads it in every
  worker). Affinity hashing is deterministic (blake2b, never the per-process
  ``hash()``), so every worker sends a key to the same endpoint.
- The supervisor owns the admin listener. It answers `/metrics` by scraping every
  worker's own admin app (a Unix socket each) and summing counters and histograms
  (gauges: `in_flight` summed, views of the fleet such as endpoint states taken
  once), so the hot path keeps prometheus-client's plain in-memory values instead of
  its multiprocess mode's mmap writes per observation. A worker that dies keeps its
  last scraped counts in the sum, so totals never go backwards. `/v1/endpoints` sums
  each endpoint's outstanding requests over the workers; `/v1/workers` lists them.
- A worker that dies is started again, after 0 s, then 0.5 s, 1 s, ... up to 30 s
  while it keeps dying young. One that cannot start at all when the router starts
  (no worker ever came up) ends the router with its error.
- SIGTERM/SIGINT: `/readyz` fails at once, every worker gets SIGTERM and drains
  (in-flight streams finish within `shutdown_grace`), then the supervisor exits.
  SIGHUP is passed to every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import glob
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
import structlog
from llmgw_proto.addr import parse_hostport

from llmgw_router.config import ApiKey, RouterConfig
from llmgw_router.endpoints import EndpointSpec

__all__ = [
    "EjectionShare",
    "MetricsMerger",
    "WorkerContext",
    "reuseport_socket",
    "run_router",
    "worker_count",
]

log = structlog.get_logger(__name__)

# Gauges that count something per worker and add up; every other gauge describes the
# fleet (endpoint states, snapshot version, engine load), is the same in every worker
# and is shown once (the highest value).
SUMMED_GAUGES = frozenset(
    {"llmgw_router_in_flight", "llmgw_router_held_requests", "llmgw_router_token_cache_bytes"}
)


def worker_count(cfg: RouterConfig) -> int:
    """`workers` from the config; unset: one per core this process may run on."""
    if cfg.workers is not None:
        return cfg.workers
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def reuseport_socket(
    address: str, *, listen: bool, backlog: int = 4096, reuse_port: bool = True
) -> socket.socket:
    """A TCP socket bound to ``address`` with SO_REUSEPORT (listening if asked)."""
    host, port = parse_hostport(address, default_host="0.0.0.0", allow_port_zero=True)
    family, kind, proto, _, addr = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
        if listen:
            sock.listen(backlog)
            sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


# ---------------------------------------------------------------- in a worker


@dataclass(frozen=True)
class WorkerContext:
    """What makes a router process one worker of several."""

    index: int
    workers: int
    runtime_dir: str

    @property
    def admin_socket(self) -> str:
        return os.path.join(self.runtime_dir, f"w{self.index}.admin")

    @property
    def peer_socket(self) -> str:
        return os.path.join(self.runtime_dir, f"w{self.index}.peer")


class _Ejection(msgspec.Struct, array_like=True):
    id: str
    url: str
    # time.monotonic() is CLOCK_MONOTONIC, the same clock in every process of a host.
    until: float
    ejections: int


_encode_ejection = msgspec.msgpack.Encoder().encode
_decode_ejection = msgspec.msgpack.Decoder(_Ejection).decode


class EjectionShare:
    """Tells the other workers of every ejection this one makes, and applies theirs.

    Ejections are found by looking, ten times a second, at the endpoints' outlier
    state rather than by a hook in the proxy: whatever ejects an endpoint, the others
    hear of it. An ejection from a peer sets the same `ejected_until` here.
    """

    def __init__(self, state: Any, context: WorkerContext, interval: float = 0.1) -> None:
        self.state = state
        self.context = context
        self.interval = interval
        # Per endpoint id: the ejection already sent or applied (its ejected_until).
        self._known: dict[str, float] = {}
        with contextlib.suppress(FileNotFoundError):
            os.unlink(context.peer_socket)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(context.peer_socket)
        self.sock.setblocking(False)
        self.received = 0

    def _peers(self) -> list[str]:
        own = self.context.peer_socket
        return [p for p in glob.glob(os.path.join(self.context.runtime_dir, "w*.peer")) if p != own]

    def broadcast(self, ep: Any) -> None:
        message = _encode_ejection(
            _Ejection(ep.id, ep.url, ep.outlier.ejected_until, ep.outlier.ejections)
        )
        for peer in self._peers():
            # A peer that is gone or restarting misses it; its own failures will tell it.
            with contextlib.suppress(OSError):
                self.sock.sendto(message, peer)

    def apply(self, message: _Ejection) -> bool:
        for ep in self.state.endpoints.endpoints:
            if ep.id == message.id and ep.url == message.url:
                self._known[ep.id] = max(self._known.get(ep.id, 0.0), message.until)
                if ep.outlier.ejected_until >= message.until:
                    return False
                ep.outlier = replace(
                    ep.outlier,
                    consecutive_failures=0,
                    ejected_until=message.until,
                    ejections=max(ep.outlier.ejections, message.ejections),
                    last_ejected_at=time.monotonic(),
                )
                log.info(
                    "endpoint ejected by another worker",
                    endpoint=ep.id,
                    seconds=round(message.until - time.monotonic(), 3),
                )
                return True
        return False

    def _on_readable(self) -> None:
        while True:
            try:
                data = self.sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            try:
                message = _decode_ejection(data)
            except msgspec.DecodeError:
                continue
            self.received += 1
            self.apply(message)

    def scan(self, now: float) -> None:
        known = self._known
        for ep in self.state.endpoints.endpoints:
            until = ep.outlier.ejected_until
            if until > now and until > known.get(ep.id, 0.0):
                known[ep.id] = until
                self.broadcast(ep)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(self.sock.fileno(), self._on_readable)
        try:
            while True:
                self.scan(time.monotonic())
                await asyncio.sleep(self.interval)
        finally:
            loop.remove_reader(self.sock.fileno())
            self.sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.context.peer_socket)


def _die_with_parent() -> None:
    """SIGTERM (drain, then exit) when the supervisor dies, however it dies."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)


class _Forked:
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


# ---------------------------------------------------------------- /metrics of all workers

_SampleKey = tuple[str, str, tuple[tuple[str, str], ...]]
_ADDED = frozenset({"counter", "histogram", "summary", "gaugehistogram", "untyped", "unknown"})


def parse_metrics(text: str) -> tuple[dict[str, tuple[str, str]], dict[_SampleKey, float]]:
    """Families (name: type, help) and samples ((family, sample, labels): value)."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, tuple[str, str]] = {}
    values: dict[_SampleKey, float] = {}
    for family in text_string_to_metric_families(text):
        families[family.name] = (family.type, family.documentation)
        for s in family.samples:
            values[(family.name, s.name, tuple(sorted(s.labels.items())))] = s.value
    return families, values


class MetricsMerger:
    """Sums the workers' metrics; a dead worker's last counts stay in the totals."""

    def __init__(self) -> None:
        self.families: dict[str, tuple[str, str]] = {}
        self._retired: dict[_SampleKey, float] = {}
        # Per worker pid: its last scrape (counters and histograms only).
        self._last: dict[int, dict[_SampleKey, float]] = {}

    def _added(self, key: _SampleKey) -> bool:
        return self.families.get(key[0], ("untyped", ""))[0] in _ADDED

    def retire(self, pid: int) -> None:
        """``pid`` has exited: its last counts are kept for good."""
        for key, value in self._last.pop(pid, {}).items():
            self._retired[key] = self._retired.get(key, 0.0) + value

    def merge(self, scrapes: dict[int, str]) -> dict[_SampleKey, float]:
        """The fleet's samples from one text exposition per live worker pid."""
        out: dict[_SampleKey, float] = {}
        for pid, text in scrapes.items():
            families, values = parse_metrics(text)
            self.families.update(families)
            self._last[pid] = {k: v for k, v in values.items() if self._added(k)}
            for key, value in values.items():
                if key not in out:
                    out[key] = value
                elif self._added(key) or key[0] in SUMMED_GAUGES:
                    out[key] += value
                else:
                    out[key] = max(out[key], value)
        for key, value in self._retired.items():
            out[key] = out.get(key, 0.0) + value
        return out

    def render(self, samples: dict[_SampleKey, float], extra: Iterable[Any] = ()) -> bytes:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.metrics_core import Metric

        by_family: dict[str, Any] = {}
        for (family, name, labels), value in samples.items():
            metric = by_family.get(family)
            if metric is None:
                kind, doc = self.families.get(family, ("untyped", ""))
                metric = by_family[family] = Metric(family, doc, kind)
            metric.add_sample(name, dict(labels), value)
        for metric in by_family.values():
            metric.samples.sort(key=_sample_order)
        metrics = [*by_family.values(), *extra]

        class _Collected:
            def collect(self) -> list[Any]:
                return metrics

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collected())
        return generate_latest(registry)


def _sample_order(sample: Any) -> tuple[Any, ...]:
    labels = sorted((k, v) for k, v in sample.labels.items() if k != "le")
    le = sample.labels.get("le")
    bound = float(le) if le is not None else 0.0
    return (labels, sample.name.endswith("_bucket") is False, bound, sample.name)


# ---------------------------------------------------------------- the supervisor


@dataclass
class _Slot:
    index: int
    proc: _Forked | None = None
    started_at: float = 0.0
    up: bool = False  # its admin socket answered /healthz
    restarts: int = 0
    attempt: int = 0
    restart_at: float = 0.0
    history: list[int] = field(default_factory=list)


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
        self.slots = [_Slot(i) for i in range(workers)]
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

    def _spawn(self, slot: _Slot) -> None:
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
        slot.proc = _Forked(pid)
        slot.up = False
        slot.started_at = time.monotonic()
        log.info("worker started", worker=slot.index, pid=pid)

    def _session(self, slot: _Slot) -> Any:
        import aiohttp

        session = self._sessions.get(slot.index)
        if session is None or session.closed:
            connector = aiohttp.UnixConnector(path=self._context(slot.index).admin_socket)
            session = aiohttp.ClientSession(connector=connector)
            self._sessions[slot.index] = session
        return session

    async def _get(self, slot: _Slot, path: str, timeout: float = 5.0) -> tuple[int, bytes, str]:
        """GET ``path`` from a worker's own admin app: status, body, content type."""
        import aiohttp

        session = self._session(slot)
        async with session.get(
            "http://worker" + path, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            return resp.status, await resp.read(), resp.headers.get("content-type", "")

    async def _fan_out(self, path: str) -> list[tuple[_Slot, int, bytes, str]]:
        live = [s for s in self.slots if s.up and s.proc is not None and s.proc.poll() is None]

        async def one(slot: _Slot) -> tuple[_Slot, int, bytes, str] | None:
            try:
                status, body, kind = await self._get(slot, path)
            except Exception:  # a worker going away: OSError, timeouts, aiohttp's errors
                return None
            return slot, status, body, kind

        results = await asyncio.gather(*(one(s) for s in live))
        return [r for r in results if r is not None]

    async def _probe_up(self, slot: _Slot) -> None:
        with contextlib.suppress(Exception):
            status, _, _ = await self._get(slot, "/healthz", timeout=1.0)
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

    # -- the admin app

    def _admin_app(self) -> Any:
        from aiohttp import web

        async def metrics(request: web.Request) -> web.Response:
            results = await self._fan_out("/metrics")
            scrapes = {
                s.proc.pid: body.decode()
                for s, status, body, _ in results
                if s.proc and status == 200
            }
            samples = self.metrics.merge(scrapes)
            per_worker = {
                s.index: _per_worker(body.decode())
                for s, status, body, _ in results
                if status == 200
            }
            body = self.metrics.render(samples, self._own_metrics(per_worker))
            from prometheus_client import CONTENT_TYPE_LATEST

            return web.Response(body=body, headers={"content-type": CONTENT_TYPE_LATEST})

        async def healthz(request: web.Request) -> web.Response:
            # Like a single router's: 200 once something serves the port, then while the
            # supervisor runs (a worker being replaced does not make the router unhealthy).
            up = sum(1 for s in self.slots if s.up and s.proc is not None)
            if not self.ever_up:
                return web.json_response({"status": "starting", "workers": up}, status=503)
            return web.json_response({"status": "ok", "workers": up})

        async def readyz(request: web.Request) -> web.Response:
            if self.stopping:
                return web.json_response({"ready": False, "reason": "shutting down"}, status=503)
            results = await self._fan_out("/readyz")
            ready = [r for r in results if r[1] == 200]
            if len(ready) == self.workers:
                self.all_ready_once = True
            if ready and self.all_ready_once:
                answer = msgspec.json.decode(ready[0][2])
                answer["workers"] = len(ready)
                return web.json_response(answer)
            reason = f"{len(ready)} of {self.workers} workers ready"
            if results and not ready:
                with contextlib.suppress(Exception):
                    reason = msgspec.json.decode(results[0][2]).get("reason", reason)
            return web.json_response({"ready": False, "reason": reason}, status=503)

        async def endpoints(request: web.Request) -> web.Response:
            results = [r for r in await self._fan_out("/v1/endpoints") if r[1] == 200]
            if not results:
                return web.json_response({"error": "no worker answered"}, status=503)
            merged = msgspec.json.decode(results[0][2])
            # The workers' counts of one endpoint add up; the rest is the first's view.
            summed = ("outstanding", "awaiting_first_byte")
            totals: dict[tuple[str, str], int] = {}
            states: dict[str, list[str]] = {}
            for _, _, body, _ in results:
                for ep in msgspec.json.decode(body).get("endpoints", []):
                    for key in summed:
                        at = (ep["id"], key)
                        totals[at] = totals.get(at, 0) + ep.get(key, 0)
                    states.setdefault(ep["id"], []).append(ep.get("state", ""))
            for ep in merged.get("endpoints", []):
                for key in summed:
                    ep[key] = totals.get((ep["id"], key), ep.get(key, 0))
                # Each worker's own view, in worker order (they agree but for moments).
                ep["state_by_worker"] = states.get(ep["id"], [])
            merged["workers"] = len(results)
            merged["engine_cache_picks"] = sum(
                msgspec.json.decode(body).get("engine_cache_picks", 0) for _, _, body, _ in results
            )
            return web.json_response(merged)

        async def workers(request: web.Request) -> web.Response:
            return web.json_response(
                {
                    "workers": [
                        {
                            "index": s.index,
                            "pid": s.proc.pid if s.proc is not None else None,
                            "up": s.up and s.proc is not None,
                            "restarts": s.restarts,
                            "exits": s.history[-5:],
                        }
                        for s in self.slots
                    ]
                }
            )

        async def other(request: web.Request) -> web.Response:
            # Anything else the admin app serves: any one worker's answer.
            for slot in self.slots:
                if slot.up and slot.proc is not None:
                    with contextlib.suppress(Exception):
                        status, body, kind = await self._get(slot, request.path_qs)
                        return web.Response(
                            status=status, body=body, headers={"content-type": kind}
                        )
            return web.json_response({"error": "no worker answered"}, status=503)

        async def match(request: web.Request) -> web.Response:
            # Precise matching explained (POST /v1/match): any one worker's answer; they
            # hear the same engine caches.
            import aiohttp

            body = await request.read()
            for slot in self.slots:
                if slot.up and slot.proc is not None:
                    with contextlib.suppress(Exception):
                        async with self._session(slot).post(
                            "http://worker/v1/match",
                            data=body,
                            timeout=aiohttp.ClientTimeout(total=5.0),
                        ) as resp:
                            return web.Response(
                                status=resp.status,
                                body=await resp.read(),
                                headers={"content-type": resp.headers.get("content-type", "")},
                            )
            return web.json_response({"error": "no worker answered"}, status=503)

        app = web.Application()
        app.router.add_post("/v1/match", match)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/healthz", healthz)
        app.router.add_get("/readyz", readyz)
        app.router.add_get("/v1/endpoints", endpoints)
        app.router.add_get("/v1/workers", workers)
        app.router.add_route("GET", "/{tail:.*}", other)
        return app

    def _own_metrics(self, per_worker: dict[int, tuple[float, float]]) -> list[Any]:
        from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

        up = GaugeMetricFamily(
            "llmgw_router_workers", "Worker processes, by state.", labels=["state"]
        )
        up.add_metric(["configured"], self.workers)
        up.add_metric(["up"], sum(1 for s in self.slots if s.up and s.proc is not None))
        restarts = CounterMetricFamily(
            "llmgw_router_worker_restarts", "Workers started again after one died."
        )
        restarts.add_metric([], sum(s.restarts for s in self.slots))
        requests = CounterMetricFamily(
            "llmgw_router_worker_requests",
            "Requests answered by each worker process (since that process started).",
            labels=["worker"],
        )
        in_flight = GaugeMetricFamily(
            "llmgw_router_worker_in_flight",
            "Requests in flight in each worker process.",
            labels=["worker"],
        )
        for index, (count, flying) in sorted(per_worker.items()):
            requests.add_metric([str(index)], count)
            in_flight.add_metric([str(index)], flying)
        return [up, restarts, requests, in_flight]

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
        runner = web.AppRunner(self._admin_app(), access_log=None, handle_signals=False)
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


def _per_worker(text: str) -> tuple[float, float]:
    """One worker's requests answered and requests in flight, from its exposition."""
    requests = in_flight = 0.0
    for line in text.splitlines():
        if line.startswith("llmgw_router_requests_total{"):
            requests += float(line.rsplit(" ", 1)[1])
        elif line.startswith("llmgw_router_in_flight{"):
            in_flight += float(line.rsplit(" ", 1)[1])
    return requests, in_flight


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
        import llmgw_router.watch  # noqa: F401
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
