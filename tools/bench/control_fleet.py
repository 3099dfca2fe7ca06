"""bench_control's processes: the real control plane (``llmgw-control serve``, pinned to a
core) and the simulated agents, each over its own real gRPC stream."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpclib.client
import grpclib.const
import yaml
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError
from llmgw_proto import v1
from llmgw_proto.backoff import Backoff
from llmgw_testkit import free_port

CONNECT = "/llmgw.v1.AgentService/Connect"
S = v1.ShardState
GiB = 2**30


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as resp:
        body = resp.read()
    return json.loads(body) if body[:1] in (b"{", b"[") else body.decode()


# --- the control plane process --------------------------------------------------------


class ControlProcess:
    def __init__(
        self,
        workdir: Path,
        agents: int,
        heartbeat: float,
        core: int,
        name: str = "control",
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.grpc_port = free_port()
        self.admin_port = free_port()
        self.core = core
        self.config = workdir / f"{name}.yaml"
        self.log = workdir / f"{name}.log"
        self.config.write_text(
            yaml.safe_dump(
                {
                    # The embedded SQLite store, next to the config, unless extra says otherwise.
                    "state": {"state_dir": str(workdir / f"{name}-state")},
                    "listen": f"127.0.0.1:{self.grpc_port}",
                    "admin_listen": f"127.0.0.1:{self.admin_port}",
                    "tls": {"insecure": True},
                    "control": {
                        "interval": "5s",
                        "heartbeat_interval": f"{heartbeat}s",
                        "unreachable_after": f"{max(10.0, heartbeat * 5)}s",
                        "lost_after": "10m",
                        "startup_grace": "10s",
                        "mgmt_interface": "lo",
                        "port_range": [20000, 20999],
                    },
                    "models": [
                        {
                            "name": "bench",
                            "profiles": {
                                "p": {"engine": "vllm", "gpus_per_node": 1, "replicas": agents}
                            },
                        }
                    ],
                    **(extra or {}),
                }
            )
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait: str = "/healthz") -> float:
        started = time.monotonic()
        core = self.core
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw_control", "serve", "--config", str(self.config),
             "--log-level", os.environ.get("BENCH_CONTROL_LOG_LEVEL", "warning"),
             "--log-format", "json"],
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: os.sched_setaffinity(0, {core}),
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if wait == "" or str(get(self.url(wait))):
                    return started
            if self.proc.poll() is not None:
                raise SystemExit(f"control exited: see {self.log}")
            time.sleep(0.05)
        raise SystemExit("control did not start within 60s")

    def kill(self) -> None:
        """SIGKILL: no goodbye, no lease handed over."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.proc = None

    def cpu_seconds(self) -> float:
        """User+system CPU time the control plane has used so far."""
        assert self.proc is not None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def runqueue_seconds(self) -> float:
        """Time the control plane was runnable but waiting for a CPU (schedstat)."""
        assert self.proc is not None
        return int(Path(f"/proc/{self.proc.pid}/schedstat").read_text().split()[1]) / 1e9

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.admin_port}{path}"

    async def summary(self) -> dict[str, Any]:
        return await asyncio.to_thread(get, self.url("/v1/summary"))

    async def metrics(self) -> str:
        return await asyncio.to_thread(get, self.url("/metrics"))


# --- simulated agents -----------------------------------------------------------------


@dataclass
class Counters:
    starts: int = 0
    stops: int = 0
    drains: int = 0


@dataclass
class SimAgent:
    node_id: str
    address: str
    port: int
    heartbeat: float
    counters: Counters
    running: dict[str, v1.RunningShard] = field(default_factory=dict)
    connected: bool = False
    # Several control planes (HA): tried in turn until one (the leader) takes the stream.
    ports: list[int] = field(default_factory=list)
    epoch: int = 0

    def register(self) -> v1.AgentMessage:
        return v1.AgentMessage(
            register=v1.Register(
                node_id=self.node_id,
                agent_version="bench",
                labels={"fabric.nvlink-domain": f"nvl-{hash(self.node_id) % 16}"},
                inventory=v1.Inventory(
                    hostname=self.node_id,
                    gpus=[v1.Gpu(index=0, uuid=f"GPU-{self.node_id}", name="NVIDIA H100",
                                 memory_total_bytes=80 * GiB)],
                    interfaces=[v1.NetworkInterface(name="lo", addresses=[self.address])],
                    simulated=True,
                ),
                shards=list(self.running.values()),
            )
        )  # fmt: skip

    async def run(self) -> None:
        backoff = Backoff(0.5, 5.0)
        turn = 0
        while True:
            port = self.ports[turn % len(self.ports)] if self.ports else self.port
            turn += 1
            channel = grpclib.client.Channel("127.0.0.1", port)
            try:
                await self.session(channel)
                backoff.reset()
            except (GRPCError, ProtocolError, StreamTerminatedError, OSError):
                pass
            finally:
                self.connected = False
                channel.close()
            await asyncio.sleep(backoff.next())

    async def session(self, channel: grpclib.client.Channel) -> None:
        async with channel.request(
            CONNECT, grpclib.const.Cardinality.STREAM_STREAM, v1.AgentMessage, v1.ControlMessage
        ) as stream:
            await stream.send_message(self.register())
            ack = await stream.recv_message()
            if ack is None or ack.register_ack is None:
                return
            self.epoch = ack.register_ack.epoch
            self.connected = True
            lock = asyncio.Lock()
            beats = asyncio.create_task(self.beat(stream, lock))
            try:
                async for msg in stream:
                    await self.obey(stream, lock, msg)
            finally:
                beats.cancel()
            async with lock:
                await stream.end()

    async def beat(self, stream: Any, lock: asyncio.Lock) -> None:
        # Spread the fleet's heartbeats over the interval, as independent nodes would be.
        await asyncio.sleep(random.random() * self.heartbeat)
        seq = 0
        while True:
            seq += 1
            msg = v1.AgentMessage(
                heartbeat=v1.Heartbeat(sequence=seq, sent_at=dt.datetime.now(dt.UTC))
            )
            async with lock:
                await stream.send_message(msg)
            await asyncio.sleep(self.heartbeat)

    async def obey(self, stream: Any, lock: asyncio.Lock, msg: v1.ControlMessage) -> None:
        out: list[v1.AgentMessage] = []
        if msg.start_shard is not None:
            s = msg.start_shard
            self.counters.starts += 1
            url = f"http://{self.address}:{s.port}"
            self.running[s.shard_id] = v1.RunningShard(
                shard_id=s.shard_id, replica_id=s.replica_id, model=s.model, profile=s.profile,
                state=S.READY, endpoint_url=url, gpu_indices=list(s.gpu_indices), port=s.port,
                pid=1, rank=0, world_size=1,
            )  # fmt: skip
            out = [
                v1.AgentMessage(command_result=v1.CommandResult(command_id=s.command_id, ok=True)),
                v1.AgentMessage(
                    shard_status=v1.ShardStatus(
                        shard_id=s.shard_id, replica_id=s.replica_id, state=S.READY,
                        endpoint_url=url,
                    )
                ),
            ]  # fmt: skip
        elif msg.stop_shard is not None or msg.drain_shard is not None:
            cmd = msg.stop_shard or msg.drain_shard
            assert cmd is not None
            if msg.stop_shard is not None:
                self.counters.stops += 1
            else:
                self.counters.drains += 1
            shard = self.running.pop(cmd.shard_id, None)
            out = [
                v1.AgentMessage(command_result=v1.CommandResult(command_id=cmd.command_id, ok=True))
            ]
            if shard is not None:
                out.append(
                    v1.AgentMessage(
                        shard_status=v1.ShardStatus(
                            shard_id=shard.shard_id, replica_id=shard.replica_id, state=S.STOPPED
                        )
                    )
                )
        async with lock:
            for m in out:
                await stream.send_message(m)
