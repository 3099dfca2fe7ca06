"""bench_control's phases: heartbeats and a reconnect storm under a simulated fleet, an HA
failover on a real etcd or PostgreSQL, and placement in this process."""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path
from typing import Any

import msgspec
import yaml
from control_fleet import ControlProcess, Counters, GiB, SimAgent
from control_measure import (
    LoopLag,
    all_ready,
    heartbeat_count,
    histogram,
    leads,
    load1,
    longest_gap,
    lost_leads,
    quantile,
    reconcile_totals,
    spread,
    start_baseline,
    store_rates,
    wait_until,
)
from llmgw_control.catalog import ModelConfig, build_catalog
from llmgw_control.inventory import Node, NodeState
from llmgw_control.placement import Demand, GpuSlot, NodeView, Placement, Placer, commit, place
from llmgw_control.reconciler import Settings, reconcile
from llmgw_control.records import ControlState


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
