"""Shared fixtures: a real `llmgw-control serve` process and scripted fake agents.

A fake agent speaks the agent side of AgentService.Connect over a real grpclib
stream (HTTP/2 on 127.0.0.1) and answers commands the way the contract says,
pretending to run engines. Each test scripts what it should do.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import ssl as ssl_module
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, Generic, Self, TypeVar

import grpclib.client
import grpclib.const
import pytest
import yaml
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError
from llmgw_proto import v1
from llmgw_testkit import Proc, free_port, http_get, untimed, wait_for_async
from llmgw_testkit.servers import Etcd, Postgres

untimed.load()  # no hypothesis deadlines: tests assert no timings

S = v1.ShardState
GiB = 2**30
CONNECT = "/llmgw.v1.AgentService/Connect"
M = TypeVar("M")
T = TypeVar("T")

FAST = {
    "interval": "0.2s",
    "heartbeat_interval": "0.3s",
    # Generous, so a test process starved on a busy machine does not lose its nodes;
    # the node-loss test asks for short ones itself.
    "unreachable_after": "3s",
    "lost_after": "30s",
    "startup_grace": "0.5s",
    "base_backoff": "0.5s",
    "max_backoff": "4s",
    "mgmt_interface": "lo",
    "drain_timeout": "30s",
    "command_timeout": "10s",
}


def control_config(
    path: Path,
    grpc_port: int,
    admin_port: int,
    models: list[dict[str, Any]],
    tls: dict[str, Any] | None = None,
    **control: Any,
) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "listen": f"127.0.0.1:{grpc_port}",
                "admin_listen": f"127.0.0.1:{admin_port}",
                "tls": tls or {"insecure": True},
                "control": {**FAST, "port_range": [21000, 21099], **control},
                "models": models,
            }
        )
    )
    return path


def model(name: str = "m", replicas: int = 1, **profile: Any) -> dict[str, Any]:
    return {
        "name": name,
        "profiles": {"p": {"engine": "vllm", "gpus_per_node": 1, "replicas": replicas, **profile}},
    }


class Control:
    """A `llmgw-control serve` subprocess and the ways a test talks to it."""

    def __init__(
        self,
        tmp_path: Path,
        models: list[dict[str, Any]],
        tls: dict[str, Any] | None = None,
        **control: Any,
    ) -> None:
        self.tmp_path = tmp_path
        self.grpc_port = free_port()
        self.admin_port = free_port()
        self.tls = tls
        self.config = control_config(
            tmp_path / "control.yaml", self.grpc_port, self.admin_port, models, tls, **control
        )
        self.proc: Proc | None = None

    def start(self) -> Control:
        self.proc = Proc(
            [sys.executable, "-m", "llmgw_control", "serve", "--config", str(self.config),
             "--log-format", "json"],
            log_dir=self.tmp_path,
            name="llmgw-control",
            grace=5.0,
        )  # fmt: skip
        self.proc.wait_output("llmgw-control serving", timeout=60)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None

    def rewrite(self, models: list[dict[str, Any]], **control: Any) -> None:
        control_config(self.config, self.grpc_port, self.admin_port, models, self.tls, **control)

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    async def get(self, path: str) -> tuple[int, Any]:
        code, body = await asyncio.to_thread(http_get, self.admin + path, 5.0)
        return code, json.loads(body) if body.startswith((b"{", b"[")) else body.decode()

    async def status(self) -> dict[str, Any]:
        code, data = await self.get("/v1/status")
        assert code == 200, data
        return data  # type: ignore[no-any-return]

    async def until(
        self, check: Callable[[dict[str, Any]], Any], what: str, timeout: float = 30.0
    ) -> Any:
        """Poll /v1/status until ``check`` returns something truthy."""

        async def probe() -> Any:
            return check(await self.status())

        return await wait_for_async(probe, timeout=timeout, interval=0.1, what=what)

    async def passes(self, count: int) -> None:
        """Wait for ``count`` more reconcile passes: time for control to act, if it would."""
        start = (await self.status())["reconciles"]
        await self.until(lambda s: s["reconciles"] >= start + count, f"{count} reconcile ticks")


@pytest.fixture
def control_factory(tmp_path: Path) -> Iterator[Callable[..., Control]]:
    made: list[Control] = []

    def make(
        models: list[dict[str, Any]], tls: dict[str, Any] | None = None, **control: Any
    ) -> Control:
        c = Control(tmp_path, models, tls, **control)
        made.append(c)
        return c.start()

    yield make
    for c in made:
        c.stop()


class FakeAgent:
    """The agent end of one node's stream, scripted.

    ``mode`` says what happens to a StartShard: "ready" (STARTING then READY),
    "starting" (stays STARTING), "fail" (CommandResult ok, then FAILED with an
    output tail, as an engine that crashed while loading), "silent" (no answer).
    """

    def __init__(
        self,
        port: int,
        node_id: str,
        *,
        gpus: int = 4,
        labels: dict[str, str] | None = None,
        mode: str = "ready",
        heartbeat: float = 0.3,
        ssl: ssl_module.SSLContext | None = None,
        register_as: str | None = None,
    ) -> None:
        self.ssl = ssl
        # The node id sent in Register, when a test wants it to differ from node_id.
        self.register_as = register_as
        self.port = port
        self.node_id = node_id
        self.gpus = gpus
        self.labels = labels if labels is not None else {"fabric.nvlink-domain": "nvl-1"}
        self.mode = mode
        self.heartbeat = heartbeat
        self.running: dict[str, v1.RunningShard] = {}
        self.commands: list[v1.ControlMessage] = []
        self.acks: list[v1.RegisterAck] = []
        self.connected = asyncio.Event()
        self.closed_by_server: list[str] = []
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._pid = 1000
        self.stream: Any = None

    # --- what the tests look at -----------------------------------------------------

    def starts(self) -> list[v1.StartShard]:
        return [c.start_shard for c in self.commands if c.start_shard is not None]

    def stops(self) -> list[v1.StopShard]:
        return [c.stop_shard for c in self.commands if c.stop_shard is not None]

    def drains(self) -> list[v1.DrainShard]:
        return [c.drain_shard for c in self.commands if c.drain_shard is not None]

    # --- life -----------------------------------------------------------------------

    def start(self, *, reconnect: bool = False) -> None:
        """Open the stream in the background; with ``reconnect``, open it again when it ends."""
        self._task = asyncio.create_task(self._run(reconnect))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        self.connected.clear()

    async def _run(self, reconnect: bool) -> None:
        while True:
            channel = grpclib.client.Channel("127.0.0.1", self.port, ssl=self.ssl)
            try:
                await self._session(channel)
            except (GRPCError, ProtocolError, StreamTerminatedError, OSError) as err:
                self.closed_by_server.append(f"{type(err).__name__}: {err}")
            except Exception as err:
                # Anything else still ends this stream: say what, rather than go quiet.
                self.closed_by_server.append(f"unexpected {type(err).__name__}: {err!r}")
            else:
                self.closed_by_server.append("ended without an error status")
            finally:
                self.connected.clear()
                channel.close()
            if not reconnect:
                return
            await asyncio.sleep(0.2)

    def _register(self) -> v1.AgentMessage:
        return v1.AgentMessage(
            register=v1.Register(
                node_id=self.node_id if self.register_as is None else self.register_as,
                agent_version="fake-0",
                labels=dict(self.labels),
                inventory=v1.Inventory(
                    hostname=self.node_id,
                    gpus=[
                        v1.Gpu(index=i, uuid=f"GPU-{self.node_id}-{i}", name="NVIDIA H100 80GB HBM3",
                               memory_total_bytes=80 * GiB)
                        for i in range(self.gpus)
                    ],
                    interfaces=[v1.NetworkInterface(name="lo", addresses=["127.0.0.1"])],
                    simulated=True,
                ),
                shards=list(self.running.values()),
            )
        )  # fmt: skip

    async def _session(self, channel: grpclib.client.Channel) -> None:
        async with channel.request(
            CONNECT, grpclib.const.Cardinality.STREAM_STREAM, v1.AgentMessage, v1.ControlMessage
        ) as stream:
            await stream.send_message(self._register())
            first = await stream.recv_message()
            assert first is not None
            assert first.register_ack is not None
            self.acks.append(first.register_ack)
            self.stream = stream
            self.connected.set()
            beats = asyncio.create_task(self._heartbeats(stream))
            try:
                async for msg in stream:
                    self.commands.append(msg)
                    await self._obey(stream, msg)
            finally:
                beats.cancel()
                with contextlib.suppress(BaseException):
                    await beats
            # The server ended its side: end ours, so leaving the block reads the
            # status (grpclib refuses to read it while our side is still open). A stream
            # the server already closed may refuse the end; the status is read all the same.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5), self._lock:
                    await stream.end()

    async def send(self, msg: v1.AgentMessage) -> None:
        """Send ``msg`` up the open stream (a test's own LoadReport, CacheEvents, ...)."""
        assert self.stream is not None, "not connected"
        await self._send(self.stream, msg)

    async def _send(self, stream: Any, msg: v1.AgentMessage) -> None:
        async with self._lock:
            await stream.send_message(msg)

    async def _heartbeats(self, stream: Any) -> None:
        seq = 0
        while True:
            seq += 1
            await self._send(
                stream,
                v1.AgentMessage(
                    heartbeat=v1.Heartbeat(sequence=seq, sent_at=dt.datetime.now(dt.UTC))
                ),
            )
            await asyncio.sleep(self.heartbeat)

    async def status(
        self, stream: Any, shard_id: str, replica_id: str, state: v1.ShardState, **kw: Any
    ) -> None:
        await self._send(
            stream,
            v1.AgentMessage(
                shard_status=v1.ShardStatus(
                    shard_id=shard_id, replica_id=replica_id, state=state,
                    time=dt.datetime.now(dt.UTC), **kw,
                )
            ),
        )  # fmt: skip

    async def _obey(self, stream: Any, msg: v1.ControlMessage) -> None:
        if msg.start_shard is not None and self.mode == "silent":
            return  # an agent that never answers: control must send it again
        if msg.start_shard is not None:
            s = msg.start_shard
            await self._send(
                stream,
                v1.AgentMessage(command_result=v1.CommandResult(command_id=s.command_id, ok=True)),
            )
            self._pid += 1
            await self.status(stream, s.shard_id, s.replica_id, S.STARTING, pid=self._pid)
            if self.mode == "fail":
                await self.status(
                    stream, s.shard_id, s.replica_id, S.FAILED, exit_code=1,
                    reason="exited with code 1 while loading",
                    output_tail="torch.OutOfMemoryError: CUDA out of memory",
                )  # fmt: skip
                return
            url = f"http://127.0.0.1:{s.port}"
            state = S.READY if self.mode == "ready" else S.STARTING
            self.running[s.shard_id] = v1.RunningShard(
                shard_id=s.shard_id, replica_id=s.replica_id, model=s.model, profile=s.profile,
                state=state, endpoint_url=url, gpu_indices=list(s.gpu_indices), port=s.port,
                pid=self._pid, rank=s.multi_node.rank if s.multi_node else 0,
                world_size=s.multi_node.size if s.multi_node else 1,
            )  # fmt: skip
            if state == S.READY:
                await self.status(stream, s.shard_id, s.replica_id, S.READY, endpoint_url=url)
        elif msg.stop_shard is not None or msg.drain_shard is not None:
            cmd = msg.stop_shard or msg.drain_shard
            assert cmd is not None
            shard = self.running.pop(cmd.shard_id, None)
            await self._send(
                stream,
                v1.AgentMessage(
                    command_result=v1.CommandResult(
                        command_id=cmd.command_id, ok=True, error="" if shard else "not running"
                    )
                ),
            )
            if shard is not None:
                if msg.drain_shard is not None:
                    await self.status(stream, shard.shard_id, shard.replica_id, S.DRAINING)
                await self.status(stream, shard.shard_id, shard.replica_id, S.STOPPED)


@pytest.fixture
async def agent_factory() -> AsyncIterator[Callable[..., FakeAgent]]:
    """Make fake agents (FakeAgent(port, node_id, ...)); all are stopped at the end."""
    made: list[FakeAgent] = []

    def make(*args: Any, **kw: Any) -> FakeAgent:
        agent = FakeAgent(*args, **kw)
        made.append(agent)
        return agent

    yield make
    for agent in made:
        await agent.stop()


@pytest.fixture
async def watcher_factory() -> AsyncIterator[Callable[[int], Watcher]]:
    """Start a Watcher on a control plane's gRPC port; all are stopped at the end."""
    made: list[Watcher] = []

    def make(port: int) -> Watcher:
        w = Watcher(port).start()
        made.append(w)
        return w

    yield make
    for w in made:
        await w.stop()


@pytest.fixture
async def load_watcher_factory() -> AsyncIterator[Callable[..., LoadWatcher]]:
    """Start a LoadWatcher (port, router_id) on a control plane; all are stopped at the end."""
    made: list[LoadWatcher] = []

    def make(port: int, router_id: str = "r1") -> LoadWatcher:
        w = LoadWatcher(port, router_id).start()
        made.append(w)
        return w

    yield make
    for w in made:
        await w.stop()


class EndpointStream(Generic[M]):
    """A router's end of one EndpointService stream (Watch, WatchLoad), collecting every
    message it receives until stopped."""

    def __init__(self, port: int, router_id: str) -> None:
        self.port = port
        self.router_id = router_id
        self.received: list[M] = []
        self._task: asyncio.Task[None] | None = None

    def open(self, stub: v1.EndpointServiceStub, request: v1.WatchRequest) -> AsyncIterator[M]:
        raise NotImplementedError

    def start(self) -> Self:
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        channel = grpclib.client.Channel("127.0.0.1", self.port)
        try:
            stub = v1.EndpointServiceStub(channel)
            async for message in self.open(stub, v1.WatchRequest(router_id=self.router_id)):
                self.received.append(message)
        finally:
            channel.close()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task

    async def wait(self, probe: Callable[[], T | None], what: str, timeout: float) -> T:
        async def check() -> T | None:
            return probe()

        return await wait_for_async(check, timeout=timeout, interval=0.05, what=what)


class Watcher(EndpointStream[v1.EndpointSnapshot]):
    """A router's end of EndpointService.Watch, collecting every snapshot."""

    def __init__(self, port: int, router_id: str = "test-router") -> None:
        super().__init__(port, router_id)

    def open(
        self, stub: v1.EndpointServiceStub, request: v1.WatchRequest
    ) -> AsyncIterator[v1.EndpointSnapshot]:
        return stub.watch(request)

    @property
    def snapshots(self) -> list[v1.EndpointSnapshot]:
        return self.received

    def latest(self) -> v1.EndpointSnapshot | None:
        return self.snapshots[-1] if self.snapshots else None

    async def until(
        self, check: Callable[[v1.EndpointSnapshot], bool], what: str, timeout: float = 30.0
    ) -> v1.EndpointSnapshot:
        def probe() -> v1.EndpointSnapshot | None:
            snap = self.latest()
            return snap if snap is not None and check(snap) else None

        return await self.wait(probe, what, timeout)


class LoadWatcher(EndpointStream[v1.LoadUpdate]):
    """A router's end of EndpointService.WatchLoad, collecting every update."""

    def __init__(self, port: int, router_id: str = "r1") -> None:
        super().__init__(port, router_id)

    def open(
        self, stub: v1.EndpointServiceStub, request: v1.WatchRequest
    ) -> AsyncIterator[v1.LoadUpdate]:
        return stub.watch_load(request)

    @property
    def updates(self) -> list[v1.LoadUpdate]:
        return self.received

    def latest_load(self, endpoint_id: str) -> v1.EndpointLoad | None:
        for update in reversed(self.updates):
            for load in update.loads:
                if load.endpoint_id == endpoint_id:
                    return load
        return None

    async def until(self, check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
        return await self.wait(check, what, timeout)


# --- real etcd and PostgreSQL servers, once per module (the store and leadership tests) --


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    server = Etcd(tmp_path_factory.mktemp("etcd"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Postgres]:
    server = Postgres(tmp_path_factory.mktemp("postgres"))
    try:
        yield server
    finally:
        server.stop()
