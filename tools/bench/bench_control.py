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

This file is the CLI and the report; control_fleet.py holds the control plane process and
the simulated agents, control_measure.py the measurements, control_phases.py the phases.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path

from control_phases import failover_phase, fleet_phases, placement_phase

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
