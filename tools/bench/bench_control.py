"""The control plane under a simulated fleet: heartbeats, a reconnect storm, placement.

    python tools/bench/bench_control.py                # 2,000 agents (the issue's targets)
    python tools/bench/bench_control.py --agents 200 --window 10   # a quick look

A real ``llmgw-control serve`` process, pinned to one core, faces many simulated
agents from this one process (pinned to the other cores), each over its own real
gRPC connection on 127.0.0.1. Every agent has one GPU and runs one shard.

1. Heartbeats: every agent sends one every ``--heartbeat`` seconds; over a window,
   heartbeats handled per second and the p99 of their lag (sent_at -> handled by
   control), from the control plane's own histogram.
2. Reconnect storm: control is restarted; agents reconnect with full-jitter backoff
   (as the real agent does). Time from the new process starting until every node is
   READY and every shard adopted, and the number of start/stop/drain commands sent
   to adopted shards (target zero).
3. Placement: 500 replicas over 1,000 nodes, in this process: the pure placement
   function alone, and one whole reconcile pass that places them all.

Each figure is printed beside its target from issue 5, with the ratio.
Loopback only; bounded by --timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpclib.client
import grpclib.const
import msgspec
import yaml
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError
from llmgw_control.catalog import ModelConfig, build_catalog
from llmgw_control.inventory import Node, NodeState
from llmgw_control.placement import Demand, GpuSlot, NodeView, Placement, Placer, commit, place
from llmgw_control.reconciler import Settings, reconcile
from llmgw_control.records import ControlState
from llmgw_proto import v1
from llmgw_proto.backoff import Backoff

CONNECT = "/llmgw.v1.AgentService/Connect"
S = v1.ShardState
GiB = 2**30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


# --- measurements ---------------------------------------------------------------------

_BUCKET = re.compile(r'^llmgw_control_(\w+)_seconds_bucket\{le="([^"]+)"\} (\S+)$', re.M)
_COUNT = re.compile(r"^llmgw_control_heartbeats_total (\S+)$", re.M)
_RECONCILE = re.compile(r"^llmgw_control_reconcile_seconds_(sum|count) (\S+)$", re.M)


_STORE = re.compile(r"^llmgw_control_store_(writes|records_written)_total (\S+)$", re.M)
_LEADER = re.compile(r"^llmgw_control_leader (\S+)$", re.M)
_GAP = re.compile(r"^llmgw_control_lease_longest_gap_seconds (\S+)$", re.M)


def store_totals(text: str) -> dict[str, float]:
    """Batches and records the control plane has written to its state store so far."""
    return {k: float(v) for k, v in _STORE.findall(text)}


def store_rates(before: str, after: str, seconds: float) -> tuple[float, float]:
    b, a = store_totals(before), store_totals(after)
    return (
        (a.get("writes", 0) - b.get("writes", 0)) / seconds,
        (a.get("records_written", 0) - b.get("records_written", 0)) / seconds,
    )


def reconcile_totals(text: str) -> dict[str, float]:
    return {k: float(v) for k, v in _RECONCILE.findall(text)}


class LoopLag:
    """How late this process's own event loop wakes up: the fleet's side of the lag."""

    def __init__(self) -> None:
        self.samples: list[float] = []

    async def run(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.01)
            self.samples.append(time.monotonic() - t - 0.01)

    def p99(self) -> float:
        return statistics.quantiles(self.samples, n=100)[98] if len(self.samples) > 100 else 0.0


def histogram(text: str, name: str = "heartbeat_lag") -> list[tuple[float, float]]:
    return [(float(le), float(n)) for metric, le, n in _BUCKET.findall(text) if metric == name]


def quantile(
    before: list[tuple[float, float]], after: list[tuple[float, float]], q: float
) -> float:
    """The q-quantile of the observations between two scrapes of a cumulative histogram."""
    deltas = [(le, a - b) for (le, a), (_, b) in zip(after, before, strict=True)]
    total = deltas[-1][1]
    if total <= 0:
        return float("nan")
    rank = q * total
    prev_le, prev_n = 0.0, 0.0
    for le, n in deltas:
        if n >= rank:
            if le == float("inf"):
                return prev_le
            # Linear inside the bucket, as Prometheus' histogram_quantile does.
            return prev_le + (le - prev_le) * (rank - prev_n) / max(n - prev_n, 1e-9)
        prev_le, prev_n = le, n
    return prev_le


# An idle asyncio process pinned beside the control plane: the machine's own noise
# floor for loop lag on that core, measured over the same window.
_BASELINE = """
import asyncio, statistics, sys, time
async def main(seconds):
    loop = asyncio.get_running_loop()
    lags, end = [], loop.time() + seconds
    while loop.time() < end:
        asked = loop.time()
        await asyncio.sleep(0.05)
        lags.append(max(loop.time() - asked - 0.05, 0.0))
    print(statistics.quantiles(lags, n=100)[98])
asyncio.run(main(float(sys.argv[1])))
"""


def start_baseline(core: int, seconds: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _BASELINE, str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: os.sched_setaffinity(0, {core}),
    )


def heartbeat_count(text: str) -> float:
    match = _COUNT.search(text)
    return float(match.group(1)) if match else 0.0


async def wait_until(
    control: ControlProcess, check: Any, what: str, timeout: float
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError):
            summary = await control.summary()
            if check(summary):
                return summary
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        await asyncio.sleep(0.25)


def all_ready(n: int) -> Any:
    return lambda s: s["nodes"].get("READY", 0) == n and s["replicas"].get("ready", 0) == n


async def fleet_phases(args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    results: dict[str, float] = {}
    control = ControlProcess(workdir, args.agents, args.heartbeat, args.control_core)
    counters = Counters()
    agents = [
        # Each its own host (127.0.0.0/8 is all loopback): engine ports are per address.
        SimAgent(
            f"node-{i:05d}",
            f"127.0.{i // 250}.{i % 250 + 1}",
            control.grpc_port,
            args.heartbeat,
            counters,
        )
        for i in range(args.agents)
    ]
    tasks: list[asyncio.Task[None]] = []
    try:
        control.start()
        t0 = time.monotonic()
        m0 = await control.metrics()
        tasks = [asyncio.create_task(a.run()) for a in agents]
        await wait_until(control, all_ready(args.agents), "the first placement", args.timeout)
        results["first placement, all READY (s)"] = time.monotonic() - t0
        results["starts sent for the first placement"] = counters.starts
        batches, records = store_rates(m0, await control.metrics(), time.monotonic() - t0)
        results["store: batches written per second, first placement"] = batches
        results["store: records written per second, first placement"] = records

        # 1. Heartbeats over a window, after things settled.
        await asyncio.sleep(args.heartbeat * 2)
        before = await control.metrics()
        cpu0 = control.cpu_seconds()
        wait0 = control.runqueue_seconds()
        baseline = start_baseline(args.control_core, args.window)
        t1 = time.monotonic()
        lag = LoopLag()
        lag_task = asyncio.create_task(lag.run())
        await asyncio.sleep(args.window)
        lag_task.cancel()
        after = await control.metrics()
        elapsed = time.monotonic() - t1
        results["control CPU during the window (% of its core)"] = (
            (control.cpu_seconds() - cpu0) / elapsed * 100
        )
        # Runnable but not running: the core was busy with someone else's work.
        results["control waiting for its core (% of the window)"] = (
            (control.runqueue_seconds() - wait0) / elapsed * 100
        )
        r0, r1 = reconcile_totals(before), reconcile_totals(after)
        if r1.get("count", 0) > r0.get("count", 0):
            results["reconcile pass, mean during the window (ms)"] = (
                (r1["sum"] - r0["sum"]) / (r1["count"] - r0["count"]) * 1e3
            )
        results["fleet process's own loop lag p99 (ms)"] = lag.p99() * 1e3
        results["heartbeats handled per second"] = (
            heartbeat_count(after) - heartbeat_count(before)
        ) / elapsed
        results["heartbeat lag p50 (ms)"] = quantile(histogram(before), histogram(after), 0.5) * 1e3
        results["heartbeat lag p99 (ms)"] = (
            quantile(histogram(before), histogram(after), 0.99) * 1e3
        )
        loop_before, loop_after = histogram(before, "loop_lag"), histogram(after, "loop_lag")
        results["control's own event-loop lag p99 (ms)"] = (
            quantile(loop_before, loop_after, 0.99) * 1e3
        )
        batches, records = store_rates(before, after, elapsed)
        results["store: records written per second, heartbeats only (never written)"] = records
        out, _ = baseline.communicate(timeout=args.window + 30)
        results["baseline: idle asyncio process on that core, loop lag p99 (ms)"] = (
            float(out.strip()) * 1e3
        )

        # 2. Restart: every replica comes back from the store, no shard is touched.
        counters.starts = counters.stops = counters.drains = 0
        control.stop()
        started = control.start()
        m0 = await control.metrics()
        summary = await wait_until(
            control,
            lambda s: all_ready(args.agents)(s),
            "the reconnect storm to settle",
            args.timeout,
        )
        storm = time.monotonic() - started
        results["reconnect storm: restart to all READY, replicas from the store (s)"] = storm
        batches, records = store_rates(m0, await control.metrics(), storm)
        results["store: batches written per second, reconnect storm"] = batches
        results["store: records written per second, reconnect storm"] = records
        # Past the startup grace, a few passes more: anything control would send, it has.
        grace_end = started + 10.0 + 3.0
        await asyncio.sleep(max(grace_end - time.monotonic(), 0.0))
        await wait_until(
            control,
            lambda s: s["reconciles"] >= summary["reconciles"] + 3,
            "three more passes",
            args.timeout,
        )
        results["commands sent to running shards after restart"] = (
            counters.starts + counters.stops + counters.drains
        )
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        control.stop()
    return results


def placement_phase(replicas: int, nodes: int, repeats: int) -> dict[str, float]:
    rng = random.Random(5)
    sizes = [1, 1, 1, 2, 2, 4, 8]

    def fleet() -> list[NodeView]:
        return [
            NodeView(
                f"node-{i:05d}",
                NodeState.READY,
                tuple(GpuSlot(g, "NVIDIA H100 80GB HBM3", 80 * GiB) for g in range(8)),
                {"fabric.nvlink-domain": f"nvl-{i // 8}"},
                "10.0.0.1",
            )
            for i in range(nodes)
        ]

    demands = [Demand(gpus_per_node=rng.choice(sizes)) for _ in range(replicas)]
    pure: list[float] = []
    for _ in range(repeats):
        views = fleet()
        t = time.perf_counter()
        placer = Placer(views, (20000, 29999))
        placed = sum(isinstance(placer.place(d), Placement) for d in demands)
        pure.append(time.perf_counter() - t)
        assert placed == replicas, placed

    # The reference: the whole filter chain over every node, for every replica.
    views = fleet()
    by_id = {v.node_id: v for v in views}
    t = time.perf_counter()
    for d in demands:
        result = place(d, views, (20000, 29999))
        if isinstance(result, Placement):
            commit(result, by_id)
    reference = time.perf_counter() - t

    # One whole reconcile pass placing them all, as the control plane runs it.
    per_size = dict.fromkeys(sizes, 0)
    for d in demands:
        per_size[d.gpus_per_node] += 1
    models = msgspec.convert(
        [
            {
                "name": f"model-{s}",
                "profiles": {"p": {"engine": "vllm", "gpus_per_node": s, "replicas": n}},
            }
            for s, n in per_size.items()
        ],
        list[ModelConfig],
    )
    catalog = build_catalog(models, "bench")
    node_records = {
        v.node_id: Node(
            v.node_id, "s", gpus=v.gpus, interfaces={"lo": ["10.0.0.1"]}, labels=dict(v.labels)
        )
        for v in fleet()
    }
    settings = Settings(port_range=(20000, 29999), mgmt_interface="lo", startup_grace=0.0)
    passes: list[float] = []
    for _ in range(repeats):
        t = time.perf_counter()
        decision = reconcile(catalog, node_records, ControlState(), 100.0, settings)
        passes.append(time.perf_counter() - t)
        assert len(decision.commands) == replicas, len(decision.commands)
    return {
        f"placement baseline: {replicas} over {nodes}, full scan per replica (s)": reference,
        f"placement: {replicas} replicas over {nodes} nodes, Placer (s)": statistics.median(pure),
        f"placement: {replicas} replicas over {nodes} nodes, one reconcile pass (s)": statistics.median(
            passes
        ),
    }


TARGETS = {
    "heartbeat lag p99 (ms)": 50.0,
    "reconnect storm: restart to all READY, replicas from the store (s)": 30.0,
    "commands sent to running shards after restart": 0.0,
    "store: records written per second, heartbeats only (never written)": 0.0,
    "failover: a standby leads after SIGKILL of the leader (s)": 10.0,
    "failover: commands sent to running shards": 0.0,
    "failover: a, leads lost before the kill (flaps)": 0.0,
    "failover: b, leads lost (flaps)": 0.0,
}


async def leads(control: ControlProcess) -> bool:
    with contextlib.suppress(OSError):
        match = _LEADER.search(await control.metrics())
        return match is not None and float(match.group(1)) == 1
    return False


async def longest_gap(control: ControlProcess) -> float:
    """The longest time between two good lease renewals the instance saw while leading."""
    match = _GAP.search(await control.metrics())
    return float(match.group(1)) if match else float("nan")


def lost_leads(control: ControlProcess) -> int:
    """How many times the instance lost the lead (its log says so each time)."""
    if not control.log.exists():
        return 0
    return control.log.read_text(errors="replace").count("lost the lead; dispatching stopped")


def load1() -> float:
    return os.getloadavg()[0]


def spread(pid: int) -> None:
    """Let every thread of ``pid`` run on any core of the machine."""
    for thread in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(thread.name), os.sched_getaffinity(1) or {0, 1})


async def failover_phase(args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    """Two HA instances on a real etcd (or PostgreSQL); SIGKILL the leader with N agents."""
    from llmgw_testkit.servers import Etcd, Postgres

    server: Etcd | Postgres
    if args.failover == "etcd":
        server = Etcd(workdir / "etcd")
        state: dict[str, Any] = {"backend": "etcd", "etcd": {"endpoints": [server.endpoint]}}
    else:
        server = Postgres(workdir / "pg")
        state = {"backend": "postgres", "postgres": {"dsn": server.dsn}}
    # The store server may use every core: started from this (fleet) process it would
    # share the fleet's core, and a starved etcd answers keep-alives too late.
    spread(server.proc.pid)
    results: dict[str, float] = {}
    instances = []
    for name in ("a", "b"):
        instances.append(
            ControlProcess(
                workdir, args.agents, args.heartbeat, args.control_core, name=name,
                extra={"state": state, "ha": {"backend": args.failover, "instance_id": name,
                                               "lease_ttl": f"{args.lease}s"}},
            )
        )  # fmt: skip
    a, b = instances
    for each in instances:
        each_extra = yaml.safe_load(each.config.read_text())
        each_extra["ha"]["advertise"] = f"127.0.0.1:{each.grpc_port}"
        each.config.write_text(yaml.safe_dump(each_extra))
    counters = Counters()
    agents = [
        SimAgent(
            f"node-{i:05d}", f"127.0.{i // 250}.{i % 250 + 1}", a.grpc_port, args.heartbeat,
            counters, ports=[a.grpc_port, b.grpc_port],
        )
        for i in range(args.agents)
    ]  # fmt: skip
    tasks: list[asyncio.Task[None]] = []
    try:
        results["failover: load average (1 min) at start"] = load1()
        a.start(wait="/metrics")
        deadline = time.monotonic() + 60
        while not await leads(a):
            if time.monotonic() > deadline:
                raise SystemExit("instance a did not lead")
            await asyncio.sleep(0.2)
        b.start(wait="/metrics")
        tasks = [asyncio.create_task(x.run()) for x in agents]
        began = time.monotonic()
        await wait_until(a, all_ready(args.agents), "all READY under a", args.timeout)
        results[f"failover: first placement, all {args.agents} READY under a (s)"] = (
            time.monotonic() - began
        )
        await asyncio.sleep(args.heartbeat * 2)
        counters.starts = counters.stops = counters.drains = 0
        epoch_a = max(x.epoch for x in agents)
        results["failover: a, longest gap between lease renewals (s)"] = await longest_gap(a)
        results["failover: a, leads lost before the kill (flaps)"] = lost_leads(a)
        results["failover: load average (1 min) at the kill"] = load1()
        a.kill()
        killed = time.monotonic()
        while not await leads(b):
            if time.monotonic() - killed > args.timeout:
                raise SystemExit("b did not lead")
            await asyncio.sleep(0.05)
        results["failover: a standby leads after SIGKILL of the leader (s)"] = (
            time.monotonic() - killed
        )
        await wait_until(b, all_ready(args.agents), "all READY under b", args.timeout)
        results[f"failover: all {args.agents} agents READY under the new leader (s)"] = (
            time.monotonic() - killed
        )
        summary = await b.summary()
        await wait_until(
            b, lambda s: s["reconciles"] >= summary["reconciles"] + 3, "passes", args.timeout
        )
        results["failover: commands sent to running shards"] = (
            counters.starts + counters.stops + counters.drains
        )
        results["failover: agents on a newer epoch"] = sum(x.epoch > epoch_a for x in agents)
        results["failover: b, longest gap between lease renewals (s)"] = await longest_gap(b)
        results["failover: b, leads lost (flaps)"] = lost_leads(b)
        if not await leads(b):
            raise SystemExit("b no longer leads at the end")
        results["failover: load average (1 min) at the end"] = load1()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for each in instances:
            each.stop()
        server.stop()
    return results


def report(results: dict[str, float]) -> None:
    if not results:
        print("\nnothing measured")
        return
    width = max(len(k) for k in results)
    print(f"\n{'measure'.ljust(width)}  {'value':>10}  {'target':>8}  {'ratio':>6}")
    for name, value in results.items():
        target = TARGETS.get(name)
        if target is None and name.startswith("placement"):
            target = 1.0
        shown = f"{value:10.3f}" if isinstance(value, float) else f"{value:10d}"
        if target is None:
            print(f"{name.ljust(width)}  {shown}")
        elif target == 0:
            print(f"{name.ljust(width)}  {shown}  {'0':>8}  {'ok' if value == 0 else 'MISS':>6}")
        else:
            print(f"{name.ljust(width)}  {shown}  {target:8g}  {value / target:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=2000)
    parser.add_argument("--heartbeat", type=float, default=2.0)
    parser.add_argument("--window", type=float, default=20.0, help="heartbeat window, seconds")
    parser.add_argument("--timeout", type=float, default=180.0, help="limit of each phase")
    parser.add_argument("--control-core", type=int, default=0)
    parser.add_argument("--skip-fleet", action="store_true", help="placement only")
    parser.add_argument(
        "--failover",
        choices=["etcd", "postgres", "none"],
        default="etcd",
        help="HA failover phase on a real etcd or PostgreSQL started here",
    )
    parser.add_argument("--lease", type=float, default=5.0, help="HA lease_ttl, seconds")
    parser.add_argument("--skip-placement", action="store_true")
    parser.add_argument("--only-failover", action="store_true", help="the failover phase alone")
    args = parser.parse_args()

    cores = os.sched_getaffinity(0)
    others = cores - {args.control_core}
    if others:
        # The simulated fleet stays off the control plane's core.
        os.sched_setaffinity(0, others)
    print(
        f"control pinned to core {args.control_core}; {args.agents} agents on cores "
        f"{sorted(others) or sorted(cores)}; heartbeat every {args.heartbeat:g}s"
    )
    results: dict[str, float] = {}
    if not args.skip_fleet and not args.only_failover:
        with tempfile.TemporaryDirectory(prefix="bench-control-") as tmp:
            try:
                results.update(asyncio.run(fleet_phases(args, Path(tmp))))
            finally:
                log = Path(tmp) / "control.log"
                if log.exists():
                    errors = [ln for ln in log.read_text().splitlines() if '"error"' in ln]
                    if errors:
                        print(f"control logged {len(errors)} error(s); first: {errors[0][:300]}")
    if not args.skip_fleet and args.failover != "none":
        with tempfile.TemporaryDirectory(prefix="bench-failover-") as tmp:
            try:
                results.update(asyncio.run(failover_phase(args, Path(tmp))))
            except SystemExit as err:
                # The figures measured so far are still worth printing.
                print(f"failover phase failed: {err}")
            finally:
                for name in ("a", "b"):
                    log = Path(tmp) / f"{name}.log"
                    if log.exists():
                        errors = [ln for ln in log.read_text().splitlines() if '"error"' in ln]
                        if errors:
                            print(f"{name} logged {len(errors)} error(s): {errors[0][:300]}")
    if not args.skip_placement:
        results.update(placement_phase(500, 1000, 3))
    report(results)


if __name__ == "__main__":
    main()
