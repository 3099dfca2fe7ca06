"""Shared fixtures: a fake NVML, StartShard builders, engine scripts, agent configs."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import os
import signal
import ssl
import sys
import textwrap
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpclib.const
import grpclib.server
import pynvml
import pytest
import structlog
from llmgw_agent.config import AgentConfig
from llmgw_proto import v1
from llmgw_proto.config import convert
from llmgw_testkit import untimed

untimed.load()  # no hypothesis deadlines: tests assert no timings


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H200"
    total: int = 141 * 1024**3
    used: int = 0
    util: int = 0
    bus_id: str = "00000000:18:00.0"
    # link number -> remote bus id; None: NVLink not supported on this GPU.
    links: dict[int, str] | None = None
    # method name -> exception raised when that method is called for this GPU.
    errors: dict[str, Exception] = field(default_factory=dict)


class FakeNvml:
    """Behaves like NVML through the agent's Nvml protocol, errors included."""

    max_links = 18

    def __init__(
        self,
        gpus: list[FakeGpu] | None = None,
        *,
        init_error: Exception | None = None,
        count_error: Exception | None = None,
        driver: str = "570.86.15",
        cuda: int = 12080,
    ) -> None:
        self.gpus = gpus or []
        self.init_error = init_error
        self.count_error = count_error
        self.driver = driver
        self.cuda = cuda
        self.initialized = False
        self.shutdowns = 0

    def _gpu(self, handle: Any, method: str) -> FakeGpu:
        assert self.initialized, "NVML call before nvmlInit"
        gpu: FakeGpu = self.gpus[handle]
        if method in gpu.errors:
            raise gpu.errors[method]
        return gpu

    def init(self) -> None:
        if self.init_error is not None:
            raise self.init_error
        self.initialized = True

    def shutdown(self) -> None:
        self.shutdowns += 1
        self.initialized = False

    def driver_version(self) -> str:
        return self.driver

    def cuda_driver_version(self) -> int:
        return self.cuda

    def device_count(self) -> int:
        if self.count_error is not None:
            raise self.count_error
        return len(self.gpus)

    def handle(self, index: int) -> Any:
        self._gpu(index, "handle")
        return index

    def uuid(self, handle: Any) -> str:
        return self._gpu(handle, "uuid").uuid

    def name(self, handle: Any) -> str:
        return self._gpu(handle, "name").name

    def memory(self, handle: Any) -> tuple[int, int]:
        gpu = self._gpu(handle, "memory")
        return gpu.total, gpu.used

    def pci_bus_id(self, handle: Any) -> str:
        return self._gpu(handle, "pci_bus_id").bus_id

    def nvlink_active(self, handle: Any, link: int) -> bool:
        gpu = self._gpu(handle, "nvlink_active")
        if gpu.links is None:
            raise pynvml.NVMLError_NotSupported()
        if link >= 18:
            raise pynvml.NVMLError_InvalidArgument()
        return link in gpu.links

    def nvlink_remote_bus_id(self, handle: Any, link: int) -> str:
        gpu = self._gpu(handle, "nvlink_remote_bus_id")
        assert gpu.links is not None
        return gpu.links[link]

    def utilization(self, handle: Any) -> int:
        return self._gpu(handle, "utilization").util


def make_start(**overrides: Any) -> v1.StartShard:
    """A valid vLLM StartShard for a simulated 2-GPU node; override what a test needs."""
    fields: dict[str, Any] = {
        "command_id": "cmd-1",
        "shard_id": "qwen.fast.0123abcd-0",
        "replica_id": "qwen.fast.0123abcd",
        "model": "qwen",
        "profile": "fast",
        "engine": v1.EngineKind.VLLM,
        "model_ref": "Qwen/Qwen2.5-0.5B-Instruct",
        "engine_args": [],
        "gpu_indices": [0],
        "port": 20001,
        "served_model_names": ["qwen"],
    }
    fields.update(overrides)
    return v1.StartShard(**fields)


# A stand-in engine (the simulator's understudy): it prints its argv, serves
# /health (503 for SIM_LOAD seconds, then 200) and /metrics (running requests read
# from the file SIM_RUNNING_FILE), and exits with SIM_EXIT after SIM_EXIT_AFTER
# seconds; SIM_ACCESS_LOG prints an access line per request. Knobs come through the
# environment so the argv stays a real engine's.
FAKE_ENGINE = textwrap.dedent(
    r"""
    import http.server, os, signal, sys, threading, time
    args = sys.argv[1:]
    env = os.environ.get
    port = int(args[args.index("--port") + 1]) if "--port" in args else 0
    load = float(env("SIM_LOAD", "0"))
    exit_after = float(env("SIM_EXIT_AFTER", "-1"))
    exit_code = int(env("SIM_EXIT", "0"))
    running_file = env("SIM_RUNNING_FILE", "")
    t0 = time.monotonic()
    print("fake engine argv:", " ".join(args), flush=True)
    print("CUDA_VISIBLE_DEVICES=" + env("CUDA_VISIBLE_DEVICES", "<unset>"), flush=True)
    if env("SIM_IGNORE_TERM"):
        signal.signal(signal.SIGTERM, lambda *a: print("ignoring SIGTERM", flush=True))
    else:
        signal.signal(signal.SIGTERM, lambda *a: (print("got SIGTERM", flush=True), os._exit(0)))
    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def log_request(self, code="-", size="-"):
            if env("SIM_ACCESS_LOG"):  # uvicorn's access line, as vLLM and SGLang write it
                host, port = self.client_address[:2]
                print('INFO:     %s:%d - "%s" %s' % (host, port, self.requestline, code), flush=True)
        def do_GET(self):
            if self.path == "/health":
                code = 200 if time.monotonic() - t0 >= load else 503
                body = b"ok" if code == 200 else b"loading"
            elif self.path == "/metrics":
                n = "0"
                if running_file and os.path.exists(running_file):
                    n = open(running_file).read().strip() or "0"
                code, body = 200, ('vllm:num_requests_running{model_name="m"} %s\n' % n).encode()
            else:
                code, body = 404, b"no"
            self.send_response(code); self.send_header("Content-Length", str(len(body)))
            self.end_headers(); self.wfile.write(body)
    if "--headless" not in args:
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), H)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        print("listening on", port, flush=True)
    while True:
        time.sleep(0.05)
        if exit_after >= 0 and time.monotonic() - t0 >= exit_after:
            for i in range(60):
                print("dying line", i, flush=True)
            sys.exit(exit_code)
    """
)


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """Tests that call setup_logging must not leave it pointing at a closed capture."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    config = structlog.get_config()
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.configure(**config)


@pytest.fixture
def fake_engine(tmp_path: Path) -> list[str]:
    """An engine command for agent.yaml: ``python fake_engine.py`` (the adapter appends)."""
    script = tmp_path / "fake_engine.py"
    script.write_text(FAKE_ENGINE)
    return [sys.executable, str(script)]


@dataclass(frozen=True)
class Kit:
    """Test helpers handed out as a fixture (test modules cannot import conftest)."""

    FakeNvml: type[FakeNvml]
    FakeGpu: type[FakeGpu]
    FakeControl: type[FakeControl]
    make_start: Callable[..., v1.StartShard]


@pytest.fixture
def kit() -> Kit:
    return Kit(FakeNvml=FakeNvml, FakeGpu=FakeGpu, FakeControl=FakeControl, make_start=make_start)


# The fake engine prints no help: its flags are those of the captured real engines.
FLAGS_FROM = {"vllm": "captured:0.32.0", "sglang": "captured:0.5.23", "llamacpp": "captured:b11434"}


def agent_yaml(tmp_path: Path, engine: list[str], **extra: Any) -> dict[str, Any]:
    """agent.yaml content (as data) for a simulated node whose engines are ``engine``."""
    data: dict[str, Any] = {
        "node_id": "node-a",
        "control": {"tls": {"insecure": True}},
        "labels": {"fabric.nvlink-domain": "nvl-1"},
        "simulate_gpus": {"count": 4, "name": "NVIDIA H200", "memory": "141GiB"},
        "engine_host": "127.0.0.1",
        "engines": {
            name: {"command": engine, "flags_from": FLAGS_FROM[name]}
            for name in ("vllm", "sglang", "llamacpp")
        },
        "state_dir": str(tmp_path / "state"),
        "stop_grace": "10s",
        "health_interval": "100ms",
        "drain_poll_interval": "100ms",
        "base_backoff": "100ms",
        "max_backoff": "1s",
    }
    data.update(extra)
    return data


@pytest.fixture
def make_config(tmp_path: Path, fake_engine: list[str]) -> Callable[..., AgentConfig]:
    def make(**extra: Any) -> AgentConfig:
        return convert(agent_yaml(tmp_path, fake_engine, **extra), AgentConfig, source="agent.yaml")

    return make


@pytest.fixture
def reap(tmp_path: Path) -> Iterator[list[int]]:
    """Process groups to kill when the test ends, pass or fail; recorded engines too."""
    pids: list[int] = []
    yield pids
    for record_path in (tmp_path / "state" / "shards").glob("*.json"):
        with contextlib.suppress(Exception):
            pids.append(int(json.loads(record_path.read_text())["pid"]))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


class FakeControl:
    """A scripted control plane: a REAL grpclib server implementing AgentService/Connect.

    It records every message each stream brings, answers Register with RegisterAck,
    and sends whatever a test queues with :meth:`send`.
    """

    def __init__(self, port: int, heartbeat_interval: float = 0.2) -> None:
        self.port = port
        self.heartbeat_interval = heartbeat_interval
        # RegisterAck.epoch and .load_interval (0: not set).
        self.epoch = 0
        self.load_interval = 0.0
        # Set: answer every stream as a standby does (UNAVAILABLE naming this leader).
        self.standby_for: str | None = None
        # Set: refuse every stream with PERMISSION_DENIED (a certificate for another node).
        self.deny = False
        self.refused = 0
        # One list of received messages per stream, in order.
        self.streams: list[list[v1.AgentMessage]] = []
        self._outgoing: asyncio.Queue[v1.ControlMessage] = asyncio.Queue()
        self._server: grpclib.server.Server | None = None
        self._transports: list[asyncio.Transport] = []
        self.peer_certs: list[dict[str, Any] | None] = []

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            "/llmgw.v1.AgentService/Connect": grpclib.const.Handler(
                self._connect,
                grpclib.const.Cardinality.STREAM_STREAM,
                v1.AgentMessage,
                v1.ControlMessage,
            )
        }

    async def start(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self._server = grpclib.server.Server([self])
        await self._server.start("127.0.0.1", self.port, ssl=ssl_context)

    async def stop(self) -> None:
        """The control plane goes away: listener and every open stream."""
        if self._server is not None:
            self._server.close()
            # A control plane that exits drops its TCP connections; closing the server
            # alone would only cancel the handlers and leave the streams hanging.
            for transport in self._transports:
                transport.abort()
            self._transports.clear()
            await self._server.wait_closed()
            self._server = None

    def send(self, message: v1.ControlMessage) -> None:
        self._outgoing.put_nowait(message)

    async def _connect(
        self, stream: grpclib.server.Stream[v1.AgentMessage, v1.ControlMessage]
    ) -> None:
        if self.standby_for is not None or self.deny:
            self.refused += 1
            status = (
                grpclib.const.Status.PERMISSION_DENIED
                if self.deny
                else grpclib.const.Status.UNAVAILABLE
            )
            await stream.send_trailing_metadata(
                status=status,
                status_message="not the leader" if not self.deny else "node id mismatch",
                # grpclib refuses an empty metadata value: name a leader only when known.
                metadata={"llmgw-leader": self.standby_for} if self.standby_for else None,
            )
            return
        received: list[v1.AgentMessage] = []
        self.streams.append(received)
        self._transports.append(stream.peer._transport)
        self.peer_certs.append(stream.peer.cert())
        first = await stream.recv_message()
        assert first is not None
        received.append(first)
        await stream.send_message(
            v1.ControlMessage(
                register_ack=v1.RegisterAck(
                    session_id=f"s{len(self.streams)}",
                    heartbeat_interval=datetime.timedelta(seconds=self.heartbeat_interval),
                    epoch=self.epoch,
                    load_interval=datetime.timedelta(seconds=self.load_interval)
                    if self.load_interval
                    else None,
                )
            )
        )

        async def pump() -> None:
            while True:
                await stream.send_message(await self._outgoing.get())

        sender = asyncio.create_task(pump())
        try:
            async for message in stream:
                received.append(message)
        finally:
            sender.cancel()

    # ---- what tests look at ----

    def registers(self) -> list[v1.Register]:
        return [m[0].register for m in self.streams if m and m[0].register is not None]

    def statuses(self, stream: int | None = None) -> list[v1.ShardStatus]:
        chosen = self.streams if stream is None else [self.streams[stream]]
        return [m.shard_status for s in chosen for m in s if m.shard_status is not None]

    def results(self) -> list[v1.CommandResult]:
        return [m.command_result for s in self.streams for m in s if m.command_result is not None]

    def load_reports(self) -> list[v1.LoadReport]:
        return [m.load_report for s in self.streams for m in s if m.load_report is not None]

    def heartbeats(self, stream: int = -1) -> list[v1.Heartbeat]:
        if not self.streams:
            return []
        return [m.heartbeat for m in self.streams[stream] if m.heartbeat is not None]


@pytest.fixture
async def control() -> AsyncIterator[FakeControl]:
    from llmgw_testkit import free_port

    fake = FakeControl(free_port())
    await fake.start()
    yield fake
    await fake.stop()
