"""Running the router: the proxy and admin servers, background tasks, shutdown.

SIGTERM (or SIGINT) first marks the router draining (`/readyz` fails), then the
proxy server stops accepting and gives in-flight requests `shutdown_grace`
seconds; the admin server, watcher and health checks stop last. SIGHUP reads the
API keys file again (a bad file keeps the keys in use and says why).

As one of several workers (see the workers package) the same router listens on its own
SO_REUSEPORT socket, serves its admin app on a Unix socket for the supervisor, and
shares ejections with its peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import socket
from collections.abc import Iterator
from typing import Any

import aiohttp
import structlog
import uvicorn
from llmgw_proto import tracing
from llmgw_proto.addr import parse_hostport

from llmgw_router.admin import admin_app
from llmgw_router.config import ApiKey, RouterConfig, resolve_api_keys
from llmgw_router.endpoints import Endpoint, EndpointSet, EndpointSpec
from llmgw_router.front.framing import OpenAIErrorsProtocol
from llmgw_router.front.protocol import protocol_factory, sweep_idle, sweep_interval
from llmgw_router.health import HealthChecker
from llmgw_router.metrics import Metrics
from llmgw_router.proxy import ProxyApp
from llmgw_router.state import RouterState
from llmgw_router.upstream import Pool
from llmgw_router.workers.worker import EjectionShare, WorkerContext, reuseport_socket

__all__ = ["run", "serve"]

log = structlog.get_logger(__name__)

# Seconds an idle client connection is kept open.
KEEP_ALIVE = 75


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: this module decides when to stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _uvicorn(
    app: Any, address: str, grace: float, *, uds: str | None = None, protocol: Any = None
) -> _Server:
    host, port = parse_hostport(address, default_host="0.0.0.0", allow_port_zero=True)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        uds=uds,
        # The proxy's own protocol (protocol.py), or for the admin app uvicorn's
        # httptools protocol with framing errors answered in OpenAI shape.
        http=protocol or OpenAIErrorsProtocol,
        lifespan="off",
        access_log=False,
        log_config=None,
        # Clients talk to the router directly; X-Forwarded-* rewriting is work for nothing.
        proxy_headers=False,
        server_header=False,
        timeout_graceful_shutdown=int(grace) or 1,
        timeout_keep_alive=KEEP_ALIVE,
        backlog=4096,
    )
    return _Server(config)


async def serve(
    config: RouterConfig,
    static: tuple[EndpointSpec, ...],
    *,
    insecure: bool = False,
    api_keys: tuple[ApiKey, ...] = (),
    worker: WorkerContext | None = None,
) -> None:
    # Spans over OTLP when `tracing.endpoint` is set (each worker exports its own).
    tracing.configure(config.tracing, "llmgw-router")
    metrics = Metrics()
    state = RouterState(
        config, EndpointSet((Endpoint(spec=s) for s in static), source="static"), metrics
    )
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    session = aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("User-Agent",),
    )
    # The request path has its own lean client (see upstream.py); health checks use aiohttp.
    pool = Pool(per_endpoint=config.pool_per_endpoint, keepalive=config.keepalive)
    proxy = ProxyApp(state, pool, api_keys, workers=worker.workers if worker is not None else 1)
    background: list[asyncio.Task[None]] = []
    if config.health_checks.enabled:
        background.append(asyncio.create_task(HealthChecker(state, session).run()))
    if worker is not None and worker.workers > 1:
        background.append(asyncio.create_task(EjectionShare(state, worker).run()))
    if config.control is not None:
        # Imported here: grpclib and the generated messages cost a router with static
        # endpoints nearly half a second of start-up.
        from llmgw_router.control.watch import EndpointWatcher

        watcher = EndpointWatcher(
            state,
            config.control,
            insecure=insecure,
            router_id=_router_id(config.control.router_id or socket.gethostname(), worker),
            static=static,
        )
        from llmgw_router.control.keys import KeysClient

        watcher.keys = KeysClient(proxy.tenancy, watcher.router_id)
        if insecure or config.control.tls.insecure:
            log.warning(
                "control plane stream is plaintext (--insecure); use only on a trusted network"
            )
        background.append(asyncio.create_task(watcher.run()))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, _reload_keys, proxy, config)

    # A worker listens on a socket of its own (SO_REUSEPORT) and serves its admin app to
    # the supervisor only, on a Unix socket. A router of one process binds and listens
    # before its admin server starts too: once /readyz answers 200, connections to the
    # proxy are taken (the kernel queues them until the server accepts), never refused.
    try:
        listen_socket = reuseport_socket(config.listen, listen=True, reuse_port=worker is not None)
    except OSError as err:
        # The CLI found the port free a moment ago; something took it since.
        raise SystemExit(f"llmgw-router: cannot listen on {config.listen}: {err}") from None
    sockets = [listen_socket]
    admin_server = _uvicorn(
        admin_app(state),
        config.admin_listen,
        1.0,
        uds=worker.admin_socket if worker is not None else None,
    )
    admin_task = asyncio.create_task(admin_server.serve())
    proxy_task: asyncio.Task[Any]
    proxy_server: _Server | None = None
    hypercorn_stop = asyncio.Event()
    if config.server == "hypercorn":
        from hypercorn.asyncio import serve as hypercorn_serve
        from hypercorn.config import Config as HypercornConfig

        hc = HypercornConfig()
        hc.bind = [f"fd://{listen_socket.fileno()}"]
        hc.graceful_timeout = config.shutdown_grace
        hc.accesslog = None
        hc.keep_alive_timeout = 75
        # hypercorn's own limits (see the README): a head over the limit is a 431 from
        # h11, and no read may wait longer than the body timeout (closed without 408).
        hc.h11_max_incomplete_size = config.http.max_head_bytes
        hc.read_timeout = config.http.body_timeout  # type: ignore[assignment]
        proxy_task = asyncio.create_task(
            hypercorn_serve(proxy, hc, shutdown_trigger=hypercorn_stop.wait)  # type: ignore[arg-type]
        )
    else:
        # uvicorn binds and drains; the requests are read and answered by protocol.py.
        proxy_server = _uvicorn(
            proxy, config.listen, config.shutdown_grace, protocol=protocol_factory(proxy)
        )
        proxy_task = asyncio.create_task(proxy_server.serve(sockets=sockets))
        http = config.http
        every = sweep_interval(KEEP_ALIVE, http.head_timeout, http.body_timeout)
        background.append(
            asyncio.create_task(
                sweep_idle(proxy_server.server_state.connections, KEEP_ALIVE, every)
            )
        )
    log.info(
        "worker starting" if worker is not None else "router starting",
        listen=config.listen,
        admin_listen=config.admin_listen,
        server=config.server,
        endpoints=len(static),
        balancer=config.balancer,
    )
    # Everything built so far lives as long as the process: keep the collector off it.
    gc.collect()
    gc.freeze()
    stop_wait = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait(
        {stop_wait, proxy_task, admin_task}, return_when=asyncio.FIRST_COMPLETED
    )
    if stop_wait in done:
        log.info("shutting down", in_flight=state.in_flight, grace=config.shutdown_grace)
    else:
        stop_wait.cancel()
    state.draining = True
    if proxy_server is not None:
        proxy_server.should_exit = True
    hypercorn_stop.set()
    with contextlib.suppress(Exception):
        await proxy_task
    admin_server.should_exit = True
    with contextlib.suppress(Exception):
        await admin_task
    for task in background:
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    await session.close()
    pool.close()
    # What is still buffered goes out before the process ends.
    await asyncio.to_thread(tracing.shutdown)
    listen_socket.close()
    failed = [
        t for t in (proxy_task, admin_task) if t.done() and not t.cancelled() and t.exception()
    ]
    if failed or (proxy_server is not None and not proxy_server.started):
        raise SystemExit(1)
    log.info("router stopped")


def _router_id(base: str, worker: WorkerContext | None) -> str:
    # Each worker holds its own subscription; the control plane tells them apart.
    return base if worker is None or worker.workers == 1 else f"{base}/w{worker.index}"


def _reload_keys(proxy: ProxyApp, config: RouterConfig) -> None:
    """SIGHUP: the API keys file again; a file with a problem leaves the keys as they were."""
    if not config.api_keys_file:
        log.info("SIGHUP: no api_keys_file to reload")
        return
    try:
        keys = resolve_api_keys(config, "router config")
    except Exception as err:  # ConfigError, OSError: say it, keep serving
        log.error("SIGHUP: API keys not reloaded; the old ones stay", error=str(err))
        return
    proxy.set_keys(keys)  # the proxy reads its keys per request
    log.info("SIGHUP: API keys reloaded", keys=len(keys))


def run(
    config: RouterConfig,
    static: tuple[EndpointSpec, ...],
    *,
    insecure: bool = False,
    api_keys: tuple[ApiKey, ...] = (),
    worker: WorkerContext | None = None,
) -> None:
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.Runner()
    with runner:
        runner.run(serve(config, static, insecure=insecure, api_keys=api_keys, worker=worker))
