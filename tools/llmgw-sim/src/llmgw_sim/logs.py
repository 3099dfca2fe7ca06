"""Engine-flavoured log lines and failure tails.

The node agent carries an engine's last output lines into its error reports,
so failures end the way the real engine's do: a traceback-shaped tail whose
last lines name the root cause.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence

from llmgw_sim.flags import EngineKind


def _write(stream: str, text: str) -> None:
    target = sys.stderr if stream == "err" else sys.stdout
    target.write(text if text.endswith("\n") else text + "\n")
    target.flush()


class EngineLog:
    """Writes log lines in the format of one engine."""

    def __init__(self, kind: EngineKind) -> None:
        self.kind = kind
        self.pid = os.getpid()

    def info(self, msg: str, src: str = "api_server.py:1", *, core: bool = False) -> None:
        self._line("INFO", msg, src, core=core)

    def warning(self, msg: str, src: str = "api_server.py:1", *, core: bool = False) -> None:
        self._line("WARNING", msg, src, core=core)

    def error(self, msg: str, src: str = "api_server.py:1", *, core: bool = False) -> None:
        self._line("ERROR", msg, src, core=core, stream="err")

    def _line(self, level: str, msg: str, src: str, *, core: bool, stream: str = "out") -> None:
        now = time.time()
        if self.kind == "vllm":
            stamp = time.strftime("%m-%d %H:%M:%S", time.localtime(now))
            prefix = f"(EngineCore_DP0 pid={self.pid}) " if core else ""
            lines = [f"{prefix}{level} {stamp} [{src}] {part}" for part in msg.splitlines() or [""]]
        elif self.kind == "sglang":
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
            tag = " TP0" if core else ""
            lines = [f"[{stamp}{tag}] {part}" for part in msg.splitlines() or [""]]
        else:
            lines = msg.splitlines() or [""]
        _write(stream, "\n".join(lines))

    def raw(self, text: str, *, err: bool = False) -> None:
        _write("err" if err else "out", text)


def _site() -> str:
    return "/usr/local/lib/python3.12/dist-packages/{}"


def vllm_core_failure_tail(log: EngineLog, message: str, exc: str = "RuntimeError") -> None:
    """An EngineCore dying during start-up, then the API server giving up."""
    site = _site()
    frames = [
        (site.format("vllm/v1/engine/core.py"), 712, "run_engine_core",
         "engine_core = EngineCoreProc(*args, **kwargs)"),
        (site.format("vllm/v1/engine/core.py"), 498, "__init__",
         "super().__init__(vllm_config, executor_class, log_stats,"),
        (site.format("vllm/v1/engine/core.py"), 83, "__init__",
         "self.model_executor = executor_class(vllm_config)"),
        (site.format("vllm/executor/executor_base.py"), 54, "__init__",
         "self._init_executor()"),
        (site.format("vllm/v1/worker/gpu_worker.py"), 214, "load_model",
         "self.model_runner.load_model(eep_scale_up=eep_scale_up)"),
    ]  # fmt: skip
    log.error("EngineCore failed to start.", "core.py:708", core=True)
    lines = ["Traceback (most recent call last):"]
    for path, line, func, code in frames:
        lines.append(f'  File "{path}", line {line}, in {func}')
        lines.append(f"    {code}")
    lines.append(f"{exc}: {message}")
    log.error("\n".join(lines), "core.py:708", core=True)
    main_frames = [
        ("/usr/local/bin/vllm", 10, "<module>", "sys.exit(main())"),
        (site.format("vllm/entrypoints/cli/main.py"), 54, "main", "args.dispatch_function(args)"),
        (site.format("vllm/entrypoints/cli/serve.py"), 57, "cmd", "uvloop.run(run_server(args))"),
        (site.format("vllm/entrypoints/openai/api_server.py"), 1884, "run_server",
         "await run_server_worker(listen_address, sock, args, **uvicorn_kwargs)"),
        (site.format("vllm/v1/engine/utils.py"), 878, "wait_for_engine_startup",
         "raise RuntimeError("),
    ]  # fmt: skip
    tail = ["Traceback (most recent call last):"]
    for path, line, func, code in main_frames:
        tail.append(f'  File "{path}", line {line}, in {func}')
        tail.append(f"    {code}")
    tail.append(
        "RuntimeError: Engine core initialization failed. See root cause above. "
        "Failed core proc(s): {}"
    )
    log.raw("\n".join(tail), err=True)


def python_traceback_tail(
    log: EngineLog, frames: Sequence[tuple[str, int, str, str]], exc: str, message: str
) -> None:
    lines = ["Traceback (most recent call last):"]
    for path, line, func, code in frames:
        lines.append(f'  File "{path}", line {line}, in {func}')
        lines.append(f"    {code}")
    lines.append(f"{exc}: {message}")
    log.raw("\n".join(lines), err=True)


def vllm_arg_failure_tail(log: EngineLog, exc: str, message: str) -> None:
    """A config check failing in the API server process, before any engine starts."""
    site = _site()
    python_traceback_tail(
        log,
        [
            ("/usr/local/bin/vllm", 10, "<module>", "sys.exit(main())"),
            (site.format("vllm/entrypoints/cli/main.py"), 54, "main",
             "args.dispatch_function(args)"),
            (site.format("vllm/entrypoints/cli/serve.py"), 57, "cmd",
             "uvloop.run(run_server(args))"),
            (site.format("vllm/engine/arg_utils.py"), 1251, "create_engine_config",
             "parallel_config = ParallelConfig("),
            (site.format("vllm/config/parallel.py"), 418, "__post_init__", f"raise {exc}("),
        ],
        exc,
        message,
    )  # fmt: skip


def vllm_bind_failure_tail(log: EngineLog, err: OSError, *, at_listen: bool) -> None:
    """vLLM 0.32 binding its API port (SO_REUSEADDR, no SO_REUSEPORT with one API server):
    a port another process holds fails in ``sock.bind`` before any engine starts, and
    the exception escapes ``vllm serve`` as a plain traceback (exit 1)."""
    site = _site()
    frames = [
        ("/usr/local/bin/vllm", 10, "<module>", "sys.exit(main())"),
        (site.format("vllm/entrypoints/cli/main.py"), 120, "main", "args.dispatch_function(args)"),
        (site.format("vllm/entrypoints/cli/serve.py"), 156, "cmd", "uvloop.run(run_server(args))"),
    ]
    if at_listen:
        # Both bound while neither listened (two engines started at once): the
        # loser's listen() fails when its server starts after loading.
        frames += [
            (
                site.format("vllm/entrypoints/launchers/launcher.py"),
                236,
                "serve_http",
                "server_task = loop.create_task(server.serve(sockets=[sock] if sock else None))",
            ),
            (
                site.format("uvicorn/server.py"),
                154,
                "startup",
                "server = await loop.create_server(create_protocol, sock=sock, ssl=config.ssl, "
                "backlog=config.backlog)",
            ),
        ]
    else:
        frames += [
            (
                site.format("vllm/entrypoints/launchers/api_server/entry.py"),
                176,
                "run_server",
                "listen_address, sock = setup_server(args, reuse_port=False)",
            ),
            (
                site.format("vllm/entrypoints/launchers/launcher.py"),
                398,
                "setup_server",
                "sock = create_server_socket(sock_addr, reuse_port=reuse_port)",
            ),
            (
                site.format("vllm/entrypoints/launchers/launcher.py"),
                348,
                "create_server_socket",
                "sock.bind(addr)",
            ),
        ]
    python_traceback_tail(log, frames, "OSError", f"[Errno {err.errno}] {err.strerror}")


def vllm_crash_tail(log: EngineLog, message: str) -> None:
    """The engine core dying while serving: the API server reports EngineDeadError."""
    site = _site()
    log.error("EngineCore encountered a fatal error.", "core.py:710", core=True)
    lines = [
        "Traceback (most recent call last):",
        f'  File "{site.format("vllm/v1/engine/core.py")}", line 701, in run_engine_core',
        "    engine_core.run_busy_loop()",
        f'  File "{site.format("vllm/v1/engine/core.py")}", line 728, in run_busy_loop',
        "    self._process_engine_step()",
        f'  File "{site.format("vllm/v1/worker/gpu_model_runner.py")}", line 2235, in '
        "execute_model",
        "    model_output = self.model(",
        f"RuntimeError: {message}",
    ]
    log.error("\n".join(lines), "core.py:710", core=True)
    log.error("AsyncLLM output_handler failed.", "async_llm.py:480")
    log.raw(
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. "
        "See stack trace (above) for the root cause.",
        err=True,
    )


def sglang_failure_tail(log: EngineLog, message: str, exc: str = "RuntimeError") -> None:
    site = _site()
    log.error(
        "Scheduler hit an exception: Traceback (most recent call last):\n"
        f'  File "{site.format("sglang/srt/managers/scheduler.py")}", line 2651, in '
        "run_scheduler_process\n"
        "    scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank, moe_ep_rank, "
        "pp_rank, dp_rank)\n"
        f'  File "{site.format("sglang/srt/model_executor/model_runner.py")}", line 262, in '
        "__init__\n"
        "    self.initialize(min_per_gpu_memory)\n"
        f"{exc}: {message}\n",
        core=True,
    )
    log.error("Received sigquit from a child process. It usually means the child failed.")


def llama_failure_tail(log: EngineLog, model: str, message: str) -> None:
    log.raw(f"llama_model_load: error loading model: {message}", err=True)
    log.raw("llama_model_load_from_file_impl: failed to load model", err=True)
    log.raw(f"common_init_from_params: failed to load model '{model}'", err=True)
    log.raw(f"srv    load_model: failed to load model, '{model}'", err=True)
    log.raw("srv   operator(): operator(): cleaning up before exit...", err=True)
    log.raw("main: exiting due to model loading error", err=True)
