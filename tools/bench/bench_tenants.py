"""Tenants at the router (issue 27): fairness and priority at saturation, a fleet-wide
rate across routers, and what admission costs.

    python tools/bench/bench_tenants.py [--only a,b,c,d] [--seconds 30] [--minutes 3]
    python tools/bench/bench_tenants.py --only d --callgrind 500 [--keep DIR]

Every phase starts its own processes (the llmgw-sim vLLM engine, llmgw-router; for (c)
a real llmgw-control and four routers) and stops them. Ratios come from one run.

(a) fairness: tenant A offers 10x tenant B's rate, together 137 % of capacity (the
    router's `tenants.queue.per_endpoint` cap is the capacity). B's TTFT p90 with fair
    share (without and with `headroom`) against B alone, and with FIFO (both tenants'
    requests in one flow).
(b) priority: interactive traffic at 20 % of capacity beside a batch flood at 200 %:
    interactive TTFT p90 against interactive alone (without and with `headroom`).
(c) a key limited to R requests a minute (a real control plane's `keys create --rpm R`)
    offered 3R, unevenly across 4 routers (50/30/15/5 %): requests admitted per minute
    over all routers, each minute after the first.
(d) cost: router CPU per request and p50 latency with admission on (a limited key and
    the queue gate) against off (a key without limits), a closed loop of short requests;
    with --callgrind N, user-space instructions per request instead (deterministic);
    --keep DIR keeps the processes' logs and the callgrind dumps there (callgrind_annotate).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from benchlib import cpu_seconds, serving, use_uvloop
from llmgw_testkit import Proc, free_port

BIN = Path(sys.executable).parent
MODEL = "m1"


# ---------------------------------------------------------------------------- processes


@contextlib.contextmanager
def engine(logs: Path, *knobs: str) -> Iterator[str]:
    port = free_port()
    argv = [str(BIN / "llmgw-sim"), "vllm", "serve", MODEL, "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--sim-load-time", "0", *knobs]
    url = f"http://127.0.0.1:{port}"
    with serving(argv, health=url + "/health", what="engine", log_dir=logs, name="sim"):
        yield url


@contextlib.contextmanager
def router(logs: Path, config: dict[str, Any]) -> Iterator[tuple[str, Proc]]:
    port, admin = free_port(), free_port()
    config = {
        "listen": f"127.0.0.1:{port}",
        "admin_listen": f"127.0.0.1:{admin}",
        "workers": 1,
        "health_checks": {"enabled": False},
        **config,
    }
    path = logs / f"router-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = [str(BIN / "llmgw-router"), "serve", "--config", str(path), "--log-format", "json"]
    with serving(
        argv, health=f"http://127.0.0.1:{admin}/readyz", what="router", log_dir=logs,
        name=f"router-{port}",
    ) as proc:  # fmt: skip
        yield f"http://127.0.0.1:{port}", proc


# ---------------------------------------------------------------------------- load


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def ttft_one(
    session: aiohttp.ClientSession, url: str, key: str, max_tokens: int, into: list[float]
) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    start = time.perf_counter()
    first: float | None = None
    async with session.post(
        url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
    ) as resp:
        if resp.status != 200:
            await resp.read()
            return
        async for line in resp.content:
            if first is None and line.startswith(b"data: ") and b'"content"' in line:
                first = time.perf_counter() - start
    if first is not None:
        into.append(first)


async def poisson(
    session: aiohttp.ClientSession,
    url: str,
    key: str,
    rate: float,
    seconds: float,
    into: list[float],
    max_tokens: int,
    seed: int,
) -> None:
    """Requests at ``rate`` a second (Poisson arrivals) for ``seconds``; TTFTs into ``into``."""
    rng = random.Random(seed)
    tasks = []
    end = time.monotonic() + seconds
    next_at = time.monotonic()
    while True:
        next_at += rng.expovariate(rate)
        if next_at >= end:
            break
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        tasks.append(asyncio.create_task(ttft_one(session, url, key, max_tokens, into)))
    await asyncio.gather(*tasks, return_exceptions=True)


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=600)
    )


# ---------------------------------------------------------------------------- phases

# An engine request lasts about 1.5 s (0.5 s to the first token, 10 tokens at 100 ms),
# and the router lets 24 at a time through: capacity is 16 requests a second.
SLOTS = 24
KNOBS = ("--sim-ttft", "0.5", "--sim-itl", "0.1")
TOKENS = 10
CAPACITY = SLOTS / (0.5 + TOKENS * 0.1)


def saturated_config(url: str, keys: list[dict[str, Any]], headroom: int = 0) -> dict[str, Any]:
    queue = {"per_endpoint": SLOTS, "headroom": headroom, "max_wait": "300s"}
    return {
        "endpoints": [{"id": "e1", "url": url, "models": [MODEL]}],
        "tenants": {"queue": queue},
        "api_keys": keys,
    }


@contextlib.contextmanager
def saturated(logs: Path, keys: list[dict[str, Any]], headroom: int = 0) -> Iterator[str]:
    """A fresh engine behind a router with the queue's cap: the router's URL."""
    with (
        engine(logs, *KNOBS) as url,
        router(logs, saturated_config(url, keys, headroom)) as (
            r,
            _,
        ),
    ):
        yield r


async def _mix(url: str, flows: list[tuple[str, float]], seconds: float) -> list[list[float]]:
    out: list[list[float]] = [[] for _ in flows]
    async with session() as s:
        await asyncio.gather(
            *(
                poisson(s, url, key, rate, seconds, out[i], TOKENS, seed=i + 1)
                for i, (key, rate) in enumerate(flows)
            )
        )
    return out


def phase_a(logs: Path, seconds: float, load: float = 1.0) -> list[str]:
    b_rate = CAPACITY * 1.37 * load / 11
    a_rate = 10 * b_rate
    keys = [
        {"key": "sk-a", "name": "tenant-a"},
        {"key": "sk-b", "name": "tenant-b"},
        # FIFO: B's requests under A's name, so both are one flow.
        {"key": "sk-b-as-a", "name": "tenant-a"},
    ]
    with saturated(logs, keys) as r:
        (alone,) = asyncio.run(_mix(r, [("sk-b", b_rate)], seconds))
    with saturated(logs, keys) as r:
        _, fair = asyncio.run(_mix(r, [("sk-a", a_rate), ("sk-b", b_rate)], seconds))
    with saturated(logs, keys) as r:
        _, fifo = asyncio.run(_mix(r, [("sk-a", a_rate), ("sk-b-as-a", b_rate)], seconds))
    # With headroom a key below its share of the cap may go a quarter past it.
    with saturated(logs, keys, SLOTS // 4) as r:
        _, roomy = asyncio.run(_mix(r, [("sk-a", a_rate), ("sk-b", b_rate)], seconds))
    base = pct(alone, 0.9)
    return [
        f"(a) fairness: A {a_rate:.1f}/s + B {b_rate:.2f}/s = {137 * load:.0f} % of "
        f"{CAPACITY:.0f}/s, "
        f"{seconds:g} s each",
        f"    B alone         TTFT p90 {base * 1000:7.0f} ms  (n={len(alone)})",
        f"    B fair share    TTFT p90 {pct(fair, 0.9) * 1000:7.0f} ms  "
        f"= {pct(fair, 0.9) / base:.2f}x alone  (n={len(fair)})",
        f"    ... headroom {SLOTS // 4}   TTFT p90 {pct(roomy, 0.9) * 1000:7.0f} ms  "
        f"= {pct(roomy, 0.9) / base:.2f}x alone  (n={len(roomy)})",
        f"    B FIFO          TTFT p90 {pct(fifo, 0.9) * 1000:7.0f} ms  "
        f"= {pct(fifo, 0.9) / base:.2f}x alone  (n={len(fifo)})",
    ]


def phase_b(logs: Path, seconds: float, load: float = 1.0) -> list[str]:
    interactive, batch = 0.2 * CAPACITY, 2.0 * CAPACITY * load
    keys = [
        {"key": "sk-chat", "name": "chat", "priority": "interactive"},
        {"key": "sk-bulk", "name": "bulk", "priority": "batch"},
    ]
    flows = [("sk-chat", interactive), ("sk-bulk", batch)]
    with saturated(logs, keys) as r:
        (alone,) = asyncio.run(_mix(r, flows[:1], seconds))
    # With headroom the bands above batch may go a quarter past the cap.
    got: dict[int, list[float]] = {}
    for headroom in (0, SLOTS // 4):
        with saturated(logs, keys, headroom) as r:
            got[headroom], _ = asyncio.run(_mix(r, flows, seconds))
    mixed, roomy = got[0], got[SLOTS // 4]
    base = pct(alone, 0.9)
    return [
        f"(b) priority: interactive {interactive:.1f}/s (20 %) beside batch {batch:.0f}/s "
        f"({200 * load:.0f} %), {seconds:g} s each",
        f"    interactive alone       TTFT p90 {base * 1000:7.0f} ms  (n={len(alone)})",
        f"    beside the batch flood  TTFT p90 {pct(mixed, 0.9) * 1000:7.0f} ms  "
        f"= {pct(mixed, 0.9) / base:.2f}x alone  (n={len(mixed)})",
        f"    ... headroom {SLOTS // 4}     TTFT p90 {pct(roomy, 0.9) * 1000:7.0f} ms  "
        f"= {pct(roomy, 0.9) / base:.2f}x alone  (n={len(roomy)})",
    ]


@contextlib.contextmanager
def control_plane(logs: Path) -> Iterator[tuple[str, str]]:
    grpc, admin = free_port(), free_port()
    work = logs / "control"
    work.mkdir(exist_ok=True)
    config = work / "control.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "listen": f"127.0.0.1:{grpc}",
                "admin_listen": f"127.0.0.1:{admin}",
                "tls": {"insecure": True},
                "state": {"state_dir": str(work / "control-state")},
                "models": [],
            }
        )
    )
    argv = [sys.executable, "-m", "llmgw_control", "serve", "--config", str(config)]
    with Proc(argv, log_dir=logs, name="control", grace=5.0) as proc:
        proc.wait_output("llmgw-control serving", timeout=60)
        yield f"127.0.0.1:{grpc}", f"http://127.0.0.1:{admin}"


def phase_c(logs: Path, minutes: int, rpm: int) -> list[str]:
    weights = (0.50, 0.30, 0.15, 0.05)
    with control_plane(logs) as (grpc, admin), engine(logs) as url:
        token = logs / "control" / "control-state" / "admin.token"
        made = subprocess.run(
            [sys.executable, "-m", "llmgw_control", "keys", "create", "fleet-key",
             "--rpm", str(rpm), "--admin", admin, "--token-file", str(token)],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        secret = made.stdout.strip().splitlines()[-1]
        control: dict[str, Any] = {"address": grpc, "tls": {"insecure": True}}
        config: dict[str, Any] = {
            "endpoints": [{"id": "e1", "url": url, "models": [MODEL]}],
            "tenants": {"report_interval": "1s"},
        }
        with contextlib.ExitStack() as stack:
            urls = []
            for i in range(len(weights)):
                cfg = {**config, "control": {**control, "router_id": f"r{i}"}}
                urls.append(stack.enter_context(router(logs, cfg))[0])
            admitted = asyncio.run(_offer(urls, weights, secret, 3 * rpm, minutes))
    lines = [
        f"(c) fleet rate: a key of R = {rpm}/min offered {3 * rpm}/min over 4 routers "
        f"({'/'.join(f'{w:.0%}' for w in weights)}), {minutes} min",
    ]
    for minute, count in enumerate(admitted, 1):
        note = "  (first minute: not judged)" if minute == 1 else ""
        lines.append(f"    minute {minute}: {count} admitted = {count / rpm:.2f} R{note}")
    return lines


async def _offer(
    urls: list[str], weights: tuple[float, ...], secret: str, per_minute: int, minutes: int
) -> list[int]:
    """Offer ``per_minute`` requests a minute, split by ``weights``; 200s per minute."""
    start = time.monotonic()
    counts = [0] * minutes
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

    async def one(s: aiohttp.ClientSession, url: str) -> None:
        async with s.post(
            url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {secret}"}
        ) as resp:
            await resp.read()
            if resp.status == 200:
                minute = int((time.monotonic() - start) // 60)
                if minute < minutes:
                    counts[minute] += 1

    async def flow(s: aiohttp.ClientSession, url: str, rate: float, seed: int) -> None:
        rng = random.Random(seed)
        tasks = []
        end = start + 60 * minutes
        at = start
        while True:
            at += rng.expovariate(rate)
            if at >= end:
                break
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            tasks.append(asyncio.create_task(one(s, url)))
        await asyncio.gather(*tasks, return_exceptions=True)

    async with session() as s:
        await asyncio.gather(
            *(
                flow(s, url, per_minute / 60 * w, i)
                for i, (url, w) in enumerate(zip(urls, weights, strict=True))
            )
        )
    return counts


def phase_d(logs: Path, seconds: float) -> list[str]:
    off, on = _d_configs()
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    p50: dict[str, list[float]] = {"off": [], "on": []}
    with engine(logs) as url:
        # Alternating, so that the neighbours' load falls on both alike.
        for label, extra in (("off", off), ("on", on)) * 3:
            config = {"endpoints": [{"id": "e1", "url": url, "models": [MODEL]}], **extra}
            with router(logs, config) as (r, proc):
                got = asyncio.run(_closed_loop(r, proc.pid, seconds))
            cpu[label].append(got[0])
            p50[label].append(got[1])
    cpu_ratio = statistics.median(a / b for a, b in zip(cpu["on"], cpu["off"], strict=True))
    p50_ratio = statistics.median(a / b for a, b in zip(p50["on"], p50["off"], strict=True))
    return [
        f"(d) cost: closed loop, 8 clients, {seconds:g} s per run, off/on alternating x3 "
        "(medians; ratio: the median of the pairs')",
        f"    router CPU per request  off {statistics.median(cpu['off']) * 1e6:6.0f} us  "
        f"on {statistics.median(cpu['on']) * 1e6:6.0f} us  = {cpu_ratio:.2f}x",
        f"    p50 latency             off {statistics.median(p50['off']) * 1000:6.2f} ms  "
        f"on {statistics.median(p50['on']) * 1000:6.2f} ms  = {p50_ratio:.2f}x",
    ]


def _d_configs() -> tuple[dict[str, Any], dict[str, Any]]:
    off = {"api_keys": [{"key": "sk-x", "name": "plain"}]}
    on = {
        "api_keys": [
            {"key": "sk-x", "name": "limited", "rpm": 10**8, "tpm": 10**10,
             "max_concurrent": 10**5},
        ],
        "tenants": {"queue": {"per_endpoint": 10**5}},
    }  # fmt: skip
    return off, on


def phase_d_callgrind(logs: Path, requests: int) -> list[str]:
    """(d) in user-space instructions per request (deterministic, unlike CPU seconds on a
    shared machine): each router under `valgrind --tool=callgrind`, instrumentation on
    (callgrind_control) for ``requests`` sequential requests on one connection after a
    warm-up, the process's instructions divided by ``requests``."""
    if not shutil.which("valgrind"):
        raise SystemExit("--callgrind needs valgrind (apt-get install valgrind)")
    off, on = _d_configs()
    counts: dict[str, list[float]] = {"off": [], "on": []}
    with engine(logs) as url:
        # Alternating: periodic work (timers) counts per second, and a loaded machine
        # stretches the seconds; the lowest count of each is the least disturbed.
        for i, (label, extra) in enumerate((("off", off), ("on", on)) * 2):
            config = {
                "endpoints": [{"id": "e1", "url": url, "models": [MODEL]}],
                "workers": 1,
                "health_checks": {"enabled": False},
                **extra,
            }
            counts[label].append(_callgrind_router(logs, f"{label}{i}", config, requests))
    off_n, on_n = min(counts["off"]), min(counts["on"])
    runs = ", ".join(f"{k} {' '.join(f'{v:.0f}' for v in vs)}" for k, vs in counts.items())
    return [
        f"(d) cost under callgrind: {requests} sequential requests, one connection, "
        "off/on alternating x2 (lowest of each)",
        f"    instructions per request  off {off_n:9.0f}  on {on_n:9.0f}  = {on_n / off_n:.3f}x"
        f"  (runs: {runs})",
    ]


def _callgrind_router(logs: Path, label: str, config: dict[str, Any], requests: int) -> float:
    port, admin = free_port(), free_port()
    config = {**config, "listen": f"127.0.0.1:{port}", "admin_listen": f"127.0.0.1:{admin}"}
    path = logs / f"router-cg-{label}.yaml"
    path.write_text(yaml.safe_dump(config))
    out = logs / f"callgrind-{label}"
    argv = [
        "valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}.%p",
        str(BIN / "python"), "-m", "llmgw_router", "serve", "--config", str(path),
        "--log-level", "warning",
    ]  # fmt: skip
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    ).encode()
    headers = {"content-type": "application/json", "authorization": "Bearer sk-x"}
    proc = Proc(argv, log_dir=logs, name=f"router-cg-{label}")
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                conn.request("POST", "/v1/chat/completions", body, headers)
                answer = conn.getresponse()
                answer.read()
                if answer.status == 200:
                    break
            except OSError:
                pass
            if not proc.alive() or time.monotonic() > deadline:
                raise SystemExit(f"router under valgrind did not answer: {proc.log_path}")
            time.sleep(1)

        def one() -> None:
            conn.request("POST", "/v1/chat/completions", body, headers)
            answer = conn.getresponse()
            answer.read()
            if answer.status != 200:
                raise SystemExit(f"router under valgrind answered {answer.status}")

        for _ in range(100):
            one()
        control = ["callgrind_control"]
        subprocess.run([*control, "-i", "on", str(proc.pid)], capture_output=True, check=False)
        for _ in range(requests):
            one()
        subprocess.run([*control, "-i", "off", str(proc.pid)], capture_output=True, check=False)
        subprocess.run([*control, "-d", str(proc.pid)], capture_output=True, check=False)
        conn.close()
    finally:
        proc.stop()
    total = 0
    for dump in logs.glob(f"callgrind-{label}.*"):
        for line in dump.read_text(errors="replace").splitlines():
            if line.startswith("totals:"):
                total += int(line.split()[1])
    return total / requests


async def _closed_loop(url: str, pid: int, seconds: float) -> tuple[float, float]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    headers = {"authorization": "Bearer sk-x"}
    latencies: list[float] = []

    async def client(s: aiohttp.ClientSession, stop_at: float, record: bool) -> None:
        while time.monotonic() < stop_at:
            t = time.perf_counter()
            async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                await r.read()
                ok = r.status == 200
            if record and ok:
                latencies.append(time.perf_counter() - t)

    async with session() as s:
        warm = time.monotonic() + 1.0
        await asyncio.gather(*(client(s, warm, False) for _ in range(8)))
        cpu0 = cpu_seconds(pid)
        await asyncio.gather(*(client(s, time.monotonic() + seconds, True) for _ in range(8)))
        cpu = cpu_seconds(pid) - cpu0
    return cpu / max(1, len(latencies)), pct(latencies, 0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="a,b,c,d", help="phases to run, e.g. a,b")
    parser.add_argument("--seconds", type=float, default=30.0, help="per run of (a), (b), (d)")
    parser.add_argument("--minutes", type=int, default=3, help="length of (c)")
    parser.add_argument("--rpm", type=int, default=120, help="(c): the key's limit R")
    parser.add_argument(
        "--load",
        type=float,
        default=1.0,
        help="(a), (b): offered load times this (1: A+B at 137 %%, the batch flood at 200 %%)",
    )
    parser.add_argument(
        "--callgrind",
        type=int,
        default=0,
        help="(d): instructions per request under callgrind, N requests (needs valgrind)",
    )
    parser.add_argument(
        "--keep", default="", help="keep the logs and callgrind dumps in this (empty) folder"
    )
    args = parser.parse_args()
    if args.keep and Path(args.keep).is_dir() and any(Path(args.keep).iterdir()):
        # A dump left there would be counted with this run's (same labels).
        raise SystemExit(f"--keep {args.keep}: the folder is not empty")
    use_uvloop()
    phases = set(args.only.split(","))
    with tempfile.TemporaryDirectory(prefix="bench-tenants-") as tmp:
        logs = Path(args.keep or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        lines: list[str] = []
        if "a" in phases:
            lines += phase_a(logs, args.seconds, args.load)
        if "b" in phases:
            lines += phase_b(logs, args.seconds, args.load)
        if "c" in phases:
            lines += phase_c(logs, args.minutes, args.rpm)
        if "d" in phases and args.callgrind:
            lines += phase_d_callgrind(logs, args.callgrind)
        elif "d" in phases:
            lines += phase_d(logs, min(args.seconds, 10.0))
        print("\n".join(lines))


if __name__ == "__main__":
    main()
