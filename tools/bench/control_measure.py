"""bench_control's measurements: the control plane's metrics (histograms, store writes,
leadership), this process's own loop lag, an idle baseline process, waits on its summary."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from control_fleet import ControlProcess

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
