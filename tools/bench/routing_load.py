"""bench_routing's runs: the open-loop load generator and one run of one target on one
workload over a fresh fleet, its engines' and routers' figures read before and after."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import aiohttp
from benchlib import cpu_seconds
from llmgw_testkit.cluster import Cluster
from routing_fleet import (
    ADMINS,
    Fleet,
    control_fleet_up,
    engine_samples,
    fleet_up,
    llamacpp_fleet_up,
    reset_prefix_caches,
    router_up,
    sum_metric,
)
from routing_report import Result
from routing_workloads import MODEL, Shape, arrival_times, request_bodies


async def _one(
    session: aiohttp.ClientSession, url: str, body: bytes, at: float, start: float
) -> float | None:
    """Send at ``start + at``; the seconds to the first token, None on failure."""
    delay = start + at - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = time.monotonic()
    first: float | None = None
    try:
        async with session.post(
            url, data=body, headers={"Content-Type": "application/json"}
        ) as resp:
            if resp.status != 200:
                await resp.read()
                return None
            async for line in resp.content:
                # The first token's chunk (the role chunk before it carries none).
                if first is None and b'"delta":{"content":' in line:
                    first = time.monotonic() - sent
    except (TimeoutError, aiohttp.ClientError):
        return None
    return first


async def drive(
    urls: Sequence[str],
    bodies: Sequence[bytes],
    times: Sequence[float],
    warm: int,
    patience: float = 120.0,
) -> tuple[list[float | None], float]:
    timeout = aiohttp.ClientTimeout(total=patience)
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.monotonic() + 0.2
        tasks = [
            asyncio.create_task(
                _one(session, urls[i % len(urls)] + "/v1/chat/completions", b, t, start)
            )
            for i, (b, t) in enumerate(zip(bodies, times, strict=True))
        ]
        results = await asyncio.gather(*tasks)
        duration = time.monotonic() - (start + (times[warm] if warm < len(times) else 0))
    return list(results), duration


def _watch_idle(engines: Sequence[str], stop: threading.Event, after: float, into: Result) -> None:
    """Every 0.25 s once the warm-up arrivals are sent, each engine's running and waiting
    requests (its own /metrics): how often one had nothing to do while another queued."""
    start = time.monotonic()
    while not stop.wait(0.25):
        if time.monotonic() - start < after:
            continue
        with contextlib.suppress(OSError, ValueError):
            samples = [engine_samples(u) for u in engines]
            # vLLM's names, or llama-server's (the other's are absent: 0).
            running = [
                sum_metric(x, "vllm:num_requests_running")
                + sum_metric(x, "llamacpp:requests_processing")
                for x in samples
            ]
            waiting = [
                sum_metric(x, "vllm:num_requests_waiting")
                + sum_metric(x, "llamacpp:requests_deferred")
                for x in samples
            ]
            into.watched += 1
            if any(r == 0 and w == 0 for r, w in zip(running, waiting, strict=True)) and any(
                w > 0 for w in waiting
            ):
                into.idle_while_queued += 1


def _warm_engine(url: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        resp.read()


def _tree_cpu(pid: int) -> float:
    """CPU of a process and its children (llmgw-router may fork workers)."""
    total = cpu_seconds(pid)
    with contextlib.suppress(OSError):
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            total += _tree_cpu(int(child))
    return total


def run_one(
    fleet: Fleet, workload: str, target: str, args: argparse.Namespace, logs: Path, seed: int
) -> Result:
    shape: Shape = args.shape
    rate = args.rate or args.load * fleet.capacity(shape)
    times = arrival_times(rate, args.seconds, seed)
    bodies = request_bodies(workload, len(times), seed, shape, precise=bool(fleet.tokenizer))
    warm = int(len(times) * args.warmup)
    copies = 4 if workload == "tenants x4" else 1
    result = Result(workload, target, rate)
    result.loadavg = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    with contextlib.ExitStack() as stack:
        cluster: Cluster | None = None
        if args.engine == "vllm":
            # One fleet for every run (bench_routing starts it): its caches emptied.
            cluster, engines = args.vllm_fleet
            reset_prefix_caches(engines)
        elif args.engine == "llamacpp":
            workdir = Path(tempfile.mkdtemp(prefix="run-", dir=logs))
            cluster, engines = stack.enter_context(llamacpp_fleet_up(args, workdir))
            # The engine's first prompt (its warm-up) is not what is measured.
            for url in engines:
                _warm_engine(url)
        elif args.fleet == "control":
            workdir = Path(tempfile.mkdtemp(prefix="run-", dir=logs))
            cluster, engines = stack.enter_context(control_fleet_up(fleet, workdir))
        else:
            engines = stack.enter_context(fleet_up(fleet, logs))
        ADMINS.clear()
        urls, pids = stack.enter_context(router_up(target, engines, logs, copies, cluster))
        side = (
            [p.pid for p in (cluster.control, *cluster.agents.values()) if p is not None]
            if cluster is not None
            else []
        )
        side0 = sum(cpu_seconds(p) for p in side)
        cpu0 = sum(_tree_cpu(p) for p in pids)
        me0 = cpu_seconds(os.getpid())
        # Engine counters after the warm-up arrivals are read by a timer in the loop.
        marks: dict[str, list[dict[str, float]]] = {"before": []}

        async def main() -> tuple[list[float | None], float]:
            loop = asyncio.get_running_loop()
            if warm < len(times):
                start_at = times[warm] + 0.2

                def mark() -> None:
                    marks["before"] = [engine_samples(u) for u in engines]

                # In a thread: the load generator's loop must not wait on the scrape.
                loop.call_later(start_at, lambda: loop.run_in_executor(None, mark))
            # Real CPU engines on a busy machine: a request may wait minutes; kept.
            patience = 900.0 if args.engine == "vllm" else 120.0
            return await drive(urls, bodies, times, warm, patience)

        stop = threading.Event()
        watcher = threading.Thread(
            target=_watch_idle,
            args=(engines, stop, times[warm] if warm < len(times) else 0.0, result),
        )
        watcher.start()
        try:
            results, duration = asyncio.run(main())
        finally:
            stop.set()
            watcher.join()
        result.router_cpu = sum(_tree_cpu(p) for p in pids) - cpu0
        result.loadgen_cpu = cpu_seconds(os.getpid()) - me0
        result.control_cpu = sum(cpu_seconds(p) for p in side) - side0
        after = [engine_samples(u) for u in engines]
        for admin in ADMINS:
            with contextlib.suppress(OSError, ValueError):
                for key, value in engine_samples(f"http://127.0.0.1:{admin}").items():
                    if key.startswith("llmgw_router_picks_total{"):
                        reason = key.split('reason="', 1)[1].split('"', 1)[0]
                        result.reasons[reason] = result.reasons.get(reason, 0) + int(value)
    before = marks["before"] or [{} for _ in after]
    counted = results[warm:]
    result.sent = len(counted)
    result.ttft = [r for r in counted if r is not None]
    result.ok = len(result.ttft)
    result.errors = result.sent - result.ok
    result.duration = duration
    queries = sum(
        sum_metric(a, "vllm:prefix_cache_queries_total")
        - sum_metric(b, "vllm:prefix_cache_queries_total")
        for a, b in zip(after, before, strict=True)
    )
    hits = sum(
        sum_metric(a, "vllm:prefix_cache_hits_total")
        - sum_metric(b, "vllm:prefix_cache_hits_total")
        for a, b in zip(after, before, strict=True)
    )
    result.hit_rate = hits / queries if queries else 0.0
    for a, b in zip(after, before, strict=True):
        q = sum_metric(a, "vllm:prefix_cache_queries_total") - sum_metric(
            b, "vllm:prefix_cache_queries_total"
        )
        h = sum_metric(a, "vllm:prefix_cache_hits_total") - sum_metric(
            b, "vllm:prefix_cache_hits_total"
        )
        result.per_engine_hit.append(h / q if q else 0.0)
    if args.engine == "llamacpp":
        # llama-server counts no requests; its generated tokens over the tokens per request
        # do (roughly: the warm-up request is in them), and its prompt tokens per request.
        result.per_engine = [
            round(
                (
                    sum_metric(a, "llamacpp:tokens_predicted_total")
                    - sum_metric(b, "llamacpp:tokens_predicted_total")
                )
                / shape.out
            )
            for a, b in zip(after, before, strict=True)
        ]
        evaluated = sum(
            sum_metric(a, "llamacpp:prompt_tokens_total")
            - sum_metric(b, "llamacpp:prompt_tokens_total")
            for a, b in zip(after, before, strict=True)
        )
        result.prompt_evaluated = evaluated / max(1, sum(result.per_engine))
    else:
        result.per_engine = [
            int(
                sum_metric(a, "vllm:request_success_total")
                - sum_metric(b, "vllm:request_success_total")
            )
            for a, b in zip(after, before, strict=True)
        ]
    result.all_sent = len(times)
    return result
