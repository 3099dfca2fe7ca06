"""An engine's life: start-up checks, loading, serving, failures, graceful stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from llmgw_sim.config import (
    EngineConfig,
    StartupError,
    check_devices,
    check_kv_fits,
    check_memory,
    from_args,
)
from llmgw_sim.flags import EngineKind, parse_engine_args, resolve_version
from llmgw_sim.knobs import KnobError, load_knobs, split_sim_args
from llmgw_sim.kvevents import Publisher as KvPublisher
from llmgw_sim.kvevents import parse_config as parse_kv_events
from llmgw_sim.logs import (
    EngineLog,
    llama_failure_tail,
    sglang_failure_tail,
    vllm_arg_failure_tail,
    vllm_bind_failure_tail,
    vllm_core_failure_tail,
    vllm_crash_tail,
)

if TYPE_CHECKING:
    from llmgw_sim.httpserver import HttpServer
    from llmgw_sim.server import Engine, Route

_BACKLOG = 2048


def _access_logger() -> logging.Logger:
    logger = logging.getLogger("llmgw_sim.access")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def _exists(path: str) -> bool:
    # A single stat on a local path: cheap enough to do on the event loop.
    return os.path.exists(path)


class Lifecycle:
    def __init__(self, config: EngineConfig, log: EngineLog) -> None:
        self.config = config
        self.kind = config.kind
        self.knobs = config.knobs
        self.log = log
        self.stop = asyncio.Event()
        self.signals = 0
        self.http: HttpServer | None = None

    # ----- signals and failures --------------------------------------------

    def _on_signal(self, signum: int) -> None:
        self.signals += 1
        if self.signals > 1:
            # A second signal means "now": skip the grace period.
            self.log.raw("Received a second signal; exiting immediately.")
            os._exit(1)
        self.stop.set()

    def fail(self, err: StartupError, *, code: int = 1) -> int:
        if self.kind == "vllm":
            if err.phase == "load":
                vllm_core_failure_tail(self.log, err.message, err.exc)
            else:
                vllm_arg_failure_tail(self.log, err.exc, err.message)
        elif self.kind == "sglang":
            sglang_failure_tail(self.log, err.message, err.exc)
        else:
            llama_failure_tail(self.log, self.config.model, err.message)
        return code

    def crash(self, reason: str) -> None:
        message = self.knobs.crash_message
        if self.kind == "vllm":
            vllm_crash_tail(self.log, message)
        elif self.kind == "sglang":
            sglang_failure_tail(self.log, message)
        else:
            self.log.raw(
                "/app/ggml/src/ggml-cuda/ggml-cuda.cu:88: CUDA error\n"
                f"CUDA error: {message}\n"
                "  current device: 0, in function ggml_backend_cuda_synchronize",
                err=True,
            )
        self.log.raw(f"[llmgw-sim] simulated crash {reason}", err=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self.knobs.exit_code)

    async def _sleep_or_stop(self, seconds: float) -> bool:
        """Sleep; True when a stop signal came first."""
        if seconds <= 0:
            return self.stop.is_set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), seconds)
        return self.stop.is_set()

    async def _wait_for_file(self) -> bool:
        """Wait for --sim-load-until's file; True when a stop signal came first."""
        path = self.knobs.load_until
        while path is not None and not _exists(path):
            if await self._sleep_or_stop(0.05):
                return True
        return self.stop.is_set()

    # ----- log lines --------------------------------------------------------

    def _log_start(self) -> None:
        cfg, log = self.config, self.log
        if self.kind == "vllm":
            log.info(f"vLLM API server version {cfg.version}", "api_server.py:1839")
            log.info(f"non-default args: {cfg.non_default_args}", "utils.py:233")
            log.info(f"Using max model len {cfg.max_model_len}", "model.py:1510")
        elif self.kind == "sglang":
            args = ", ".join(f"{k}={v!r}" for k, v in cfg.non_default_args.items())
            log.info(f"server_args=ServerArgs({args})")
        else:
            build = cfg.version.lstrip("b")
            log.raw(f"build: {build} (llmgwsim) with cc (GCC) for x86_64-linux-gnu")
            log.raw(f"system info: n_threads = {os.cpu_count()}, total_threads = {os.cpu_count()}")
            log.raw("main: binding port with default address family")

    def _log_loading(self) -> None:
        cfg, log = self.config, self.log
        if self.kind == "vllm":
            log.info(
                f"Initializing a V1 LLM engine (v{cfg.version}) with config: model={cfg.model!r}, "
                f"served_model_name={cfg.primary_name}, max_seq_len={cfg.max_model_len}, "
                f"tensor_parallel_size={cfg.tp}, pipeline_parallel_size={cfg.pp}, "
                f"data_parallel_size={cfg.dp}, seed={cfg.seed}, "
                f"enable_prefix_caching={cfg.prefix_caching}",
                "core.py:77",
                core=True,
            )
            log.info(
                f"rank 0 in world size {cfg.tp * cfg.pp} is assigned as DP rank 0, PP rank 0, "
                "TP rank 0, EP rank 0",
                "parallel_state.py:1208",
                core=True,
            )
            log.info(
                f"Starting to load model {cfg.model}...", "gpu_model_runner.py:2602", core=True
            )
        elif self.kind == "sglang":
            log.info("Init torch distributed begin.", core=True)
            log.info(f"Load weight begin. avail mem={self.knobs.gpu_memory_gib:.2f} GB", core=True)
        else:
            log.raw("main: loading model")
            log.raw(f"srv    load_model: loading model '{cfg.model}'")

    def _log_loaded(self) -> None:
        cfg, log, knobs = self.config, self.log, self.knobs
        kv = cfg.kv_tokens
        if self.kind == "vllm":
            log.info(
                f"Loading weights took {knobs.load_time:.2f} seconds",
                "default_loader.py:267",
                core=True,
            )
            log.info(
                f"Model loading took 15.00 GiB and {knobs.load_time:.2f} seconds",
                "gpu_model_runner.py:2653",
                core=True,
            )
            log.info(f"GPU KV cache size: {kv:,} tokens", "kv_cache_utils.py:1087", core=True)
            log.info(
                f"Maximum concurrency for {cfg.max_model_len:,} tokens per request: "
                f"{kv / cfg.max_model_len:.2f}x",
                "kv_cache_utils.py:1091",
                core=True,
            )
        elif self.kind == "sglang":
            log.info("Load weight end. type=LlamaForCausalLM, dtype=torch.bfloat16", core=True)
            log.info(f"KV Cache is allocated. #tokens: {kv}", core=True)
            log.info(
                f"max_total_num_tokens={kv}, max_running_requests={cfg.max_num_seqs}, "
                f"context_len={cfg.max_model_len}",
                core=True,
            )
        else:
            log.raw(f"llama_context: n_ctx = {cfg.max_model_len}")
            log.raw(f"llama_kv_cache: size = {kv * 128 // 1024} MiB ({kv} cells)")
            log.raw(f"srv          init: initializing slots, n_slots = {cfg.max_num_seqs}")
            log.raw("main: model loaded")

    def _log_ready(self) -> None:
        cfg, log = self.config, self.log
        url = f"http://{cfg.host}:{cfg.port}"
        if self.kind == "vllm":
            log.info(f"Starting vLLM API server 0 on {url}", "api_server.py:1912")
            log.info("Available routes are:", "launcher.py:34")
            for route in ("/health", "/metrics", "/version", "/v1/models",
                          "/v1/chat/completions", "/v1/completions", "/v1/embeddings"):  # fmt: skip
                methods = "POST" if route.startswith("/v1/") and route != "/v1/models" else "GET"
                log.info(f"Route: {route}, Methods: {methods}", "launcher.py:42")
            log.raw(f"INFO:     Started server process [{os.getpid()}]")
            log.raw("INFO:     Waiting for application startup.")
            log.raw("INFO:     Application startup complete.")
        elif self.kind == "sglang":
            log.info("The server is fired up and ready to roll!")
        else:
            log.raw(f"main: server is listening on {url} - starting the main loop")
            log.raw("srv  update_slots: all slots are idle")

    def _log_listening_early(self) -> None:
        cfg, log = self.config, self.log
        if self.kind == "sglang":
            log.info(f"INFO:     Started server process [{os.getpid()}]")
            log.info("INFO:     Waiting for application startup.")
            log.info("INFO:     Application startup complete.")
            log.info(
                f"INFO:     Uvicorn running on http://{cfg.host}:{cfg.port} (Press CTRL+C to quit)"
            )
        else:
            log.raw(
                f"main: HTTP server is listening, hostname: {cfg.host}, port: {cfg.port}, "
                "http threads: 1"
            )

    # ----- serving ----------------------------------------------------------

    def _bind(self) -> socket.socket:
        """Bind the API port; SGLang and llama.cpp also listen at once.

        SO_REUSEADDR (as every engine sets it) lets a restart reuse a port in
        TIME_WAIT, and lets two engines both *bind* a port nobody listens on yet;
        whichever listens second fails, so listening is where a clash shows."""
        cfg = self.config
        infos = socket.getaddrinfo(cfg.host, cfg.port, type=socket.SOCK_STREAM)
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
            if self.kind != "vllm":
                sock.listen(_BACKLOG)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        return sock

    async def _serve(self, handler: Route, sock: socket.socket) -> None:
        from llmgw_sim.httpserver import HttpServer

        self.http = HttpServer(
            handler,
            # vLLM and SGLang answer through uvicorn.
            server_header="uvicorn" if self.kind != "llama-server" else "llama.cpp",
            access_logger=_access_logger() if self.knobs.log_requests else None,
            name=self.knobs.name,
        )
        await self.http.start(sock, backlog=_BACKLOG)

    def _bind_error(self, err: OSError, *, at_listen: bool = False) -> int:
        """Fail as the engine fails when its port is taken (each in its own words)."""
        cfg = self.config
        if self.kind == "llama-server":
            # llama-server (cpp-httplib, no SO_REUSEPORT since b8xxx) names no errno.
            self.log.raw(
                f"srv         start: couldn't bind HTTP server socket, hostname: {cfg.host}, "
                f"port: {cfg.port}",
                err=True,
            )
            self.log.raw("srv  llama_server: exiting due to HTTP server error", err=True)
            return 1
        if self.kind == "vllm":
            vllm_bind_failure_tail(self.log, err, at_listen=at_listen)
            return 1
        # SGLang serves through uvicorn.run(host, port): uvicorn logs asyncio's bind
        # error and exits with its STARTUP_FAILURE code.
        reason = (err.strerror or str(err)).lower()
        self.log.raw(
            f"ERROR:    [Errno {err.errno}] error while attempting to bind on address "
            f"({cfg.host!r}, {cfg.port}): {reason}",
            err=True,
        )
        return 3

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        cfg, knobs = self.config, self.knobs
        self._log_start()

        headless = cfg.kind == "vllm" and cfg.headless
        sock: socket.socket | None = None
        if not headless:
            # vLLM binds its port first (so a clash fails fast) but only listens
            # once the engine is up: until then connections are refused.
            try:
                sock = self._bind()
            except OSError as err:
                return self._bind_error(err)
        try:
            check_devices(cfg, os.environ)
        except StartupError as err:
            return self.fail(err)

        # Imported here so that argument errors answer before the server code loads.
        from llmgw_sim.server import Engine, build_app

        try:
            engine = Engine(cfg, self.crash)
        except StartupError as err:
            return self.fail(err)
        if cfg.kind == "sglang" and cfg.disaggregation_mode == "prefill":
            from llmgw_sim.bootstrap import serve_bootstrap

            try:
                engine.bootstrap_server = await serve_bootstrap(
                    engine.rooms, cfg.host, cfg.bootstrap_port
                )
            except OSError as err:
                return self.fail(
                    StartupError(
                        "OSError", f"bootstrap port {cfg.bootstrap_port}: {err.strerror or err}"
                    )
                )
        if cfg.kind != "vllm" and sock is not None:
            # SGLang and llama.cpp answer /health with 503 while loading.
            health_only = cfg.kind == "sglang" and cfg.node_rank > 0
            await self._serve(build_app(engine, health_only=health_only), sock)
            self._log_listening_early()

        self._log_loading()
        if await self._sleep_or_stop(knobs.load_time) or await self._wait_for_file():
            return await self._shutdown(engine)
        try:
            check_memory(cfg)
            check_kv_fits(cfg)
        except StartupError as err:
            return self.fail(err, code=knobs.exit_code)
        try:
            kv_config = parse_kv_events(cfg.kv_events_config)
            if kv_config is not None and engine.driver is not None:
                # vLLM starts its publisher with the engine core, before serving.
                engine.kv_publisher = KvPublisher(kv_config)
        except StartupError as err:
            return self.fail(err, code=knobs.exit_code)
        if knobs.fail_on_load is not None:
            return self.fail(
                StartupError("RuntimeError", knobs.fail_on_load, phase="load"), code=knobs.exit_code
            )
        self._log_loaded()

        if headless:
            self.log.info(
                f"Headless mode: node rank {cfg.node_rank} of {cfg.nnodes} serves no API and "
                f"follows the leader at {cfg.master_addr}:{cfg.master_port}.",
                "api_server.py:1150",
            )
            self.log.info(
                "Headless engine core is up; waiting for work from the leader.", core=True
            )
            self._arm_timed_crash(engine)
            await self.stop.wait()
            self.log.info(
                "Received shutdown signal; headless engine exiting.", "api_server.py:1180"
            )
            return 0

        if cfg.kind == "vllm" and sock is not None:
            try:
                # vLLM bound at start but listens only now; another engine that
                # bound the same port meanwhile may have listened first.
                sock.listen(_BACKLOG)
            except OSError as err:
                sock.close()
                return self._bind_error(err, at_listen=True)
            await self._serve(build_app(engine), sock)
        engine.ready = True
        self._log_ready()
        self._arm_timed_crash(engine)
        await self.stop.wait()
        return await self._shutdown(engine)

    def _arm_timed_crash(self, engine: Engine) -> None:
        after = self.knobs.crash_after_seconds
        if after is not None:
            asyncio.get_running_loop().call_later(after, self.crash, f"after {after} seconds")

    async def _shutdown(self, engine: Engine) -> int:
        engine.draining = True
        if engine.kv_publisher is not None:
            engine.kv_publisher.close()
            engine.kv_publisher = None
        if engine.bootstrap_server is not None:
            engine.bootstrap_server.close()
            engine.bootstrap_server = None
        running = engine.busy
        if self.kind == "llama-server":
            self.log.raw("srv    operator(): operator(): cleaning up before exit...")
        else:
            self.log.raw("INFO:     Shutting down")
            if running:
                self.log.raw(
                    f"INFO:     Waiting for {running} running request(s) to finish "
                    f"(up to {self.knobs.shutdown_grace:g}s)"
                )
        if self.http is not None:
            # Stops listening, closes idle connections, lets handlers finish
            # within the grace period, then cancels the rest.
            await self.http.shutdown(self.knobs.shutdown_grace)
        if self.kind != "llama-server":
            self.log.raw("INFO:     Application shutdown complete.")
            self.log.raw(f"INFO:     Finished server process [{os.getpid()}]")
        return 0


def _run_loop(lifecycle: Lifecycle) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is optional
        return asyncio.run(lifecycle.run())
    return int(uvloop.run(lifecycle.run()))


def run_engine(kind: EngineKind, argv: Sequence[str]) -> int:
    engine_argv, sim_args = split_sim_args(argv)
    try:
        knobs = load_knobs(sim_args, os.environ)
    except KnobError as err:
        sys.stderr.write(f"llmgw-sim: error: {err}\n")
        return 2
    try:
        version = resolve_version(kind, knobs.version)
    except ValueError as err:
        sys.stderr.write(f"llmgw-sim: error: --sim-version: {err}\n")
        return 2
    ns = parse_engine_args(kind, engine_argv, version)
    log = EngineLog(kind)
    if not 0 <= ns.port <= 65535:
        # getaddrinfo would quietly wrap the number around; refuse it instead.
        log.raw(f"error: port {ns.port} is out of range (0-65535)", err=True)
        return 1
    try:
        config = from_args(kind, ns, knobs, os.environ)
    except StartupError as err:
        if kind == "vllm":
            vllm_arg_failure_tail(log, err.exc, err.message)
        elif kind == "sglang":
            sglang_failure_tail(log, err.message, err.exc)
        else:
            log.raw(f"error: {err.message}", err=True)
        return 1
    if kind == "llama-server" and not config.model:
        log.raw("srv    load_model: failed to load model, ''", err=True)
        log.raw("main: exiting due to model loading error (no model given: use -m PATH)", err=True)
        return 1
    return _run_loop(Lifecycle(config, log))
