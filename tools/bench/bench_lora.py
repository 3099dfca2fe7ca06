"""LoRA adapters (issue 30): llmgw's demand-driven loading and routing against round robin.

    python tools/bench/bench_lora.py              # 4 replicas x 4 adapters, 40 adapters, Zipf 1.5
    python tools/bench/bench_lora.py --zipf 1.2   # flatter demand than the slots can hold
    python tools/bench/bench_lora.py --warmup 30 --only llmgw --trace   # where llmgw loses

Both fleets are the step simulator (llmgw-sim vLLM, `--sim-scheduler step`), each engine
holding at most `--max-loras` adapters, an adapter load taking `--load-time` seconds
(`--sim-lora-load-time`) and a batch slot (`--max-loras`). The same seeded open-loop
arrivals (Poisson at `--rate` a second) ask for adapters drawn from a Zipf law (exponent
`--zipf`) over `--adapters` adapters; each request is a streaming completion, its time to
first token measured at the client.

- llmgw: the real control plane, agent and router (llmgw_testkit's Cluster, over mutual
  TLS); the catalog declares the adapters and `lora: {max_loras}`; the router holds a
  request for an adapter no engine holds and the control plane has one load it (LRU
  unload when full); the router sends the rest to holders.
- round robin with load-on-demand: the client sends each request to the next engine in
  turn; an engine that does not hold the adapter loads it first (vLLM's
  /v1/load_lora_adapter), unloading its least recently used idle adapter when full.

Reported after a warm-up (`--warmup` seconds, not measured): TTFT p50/p90, adapter loads per
minute and the share of requests served by a replica that held the adapter when the request
came (llmgw: those not held at the router; round robin: those that needed no load). Bars
(issue 30): p90 <= 1/2 of round robin's, >= 90 % by a holder, loads/min <= 1/4 of round
robin's. Nothing is asserted; the figures are in the top README (Performance, "LoRA
adapters"). Zipf 1.2 cannot meet the holder and p90 bars whatever the placement: the 16
slots hold at most 85 % of its demand, so more than 10 % of requests wait for a load (1 s,
as long as round robin's p90). At Zipf 1.5 the most popular 16 take 92 % of the demand, but
a 60 s window of these arrivals has 7-10.5 % for the rest (seeds 1-6): the p90 bar sits at
that floor. `--trace` prints, per 10 s, the requests llmgw held and the loads and unloads,
each adapter by its popularity rank.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx
from llmgw_sim.testing import engine_argv
from llmgw_testkit import Proc, free_port, http_get, wait_for
from llmgw_testkit.cluster import Cluster, vllm_profile

MODEL = "base"


@dataclass(frozen=True)
class Args:
    replicas: int
    max_loras: int
    adapters: int
    rate: float
    duration: float
    warmup: float
    zipf: float
    load_time: float
    seed: int
    # lora.min_idle of llmgw's profile (seconds).
    min_idle: float = 2.0


def engine_env(a: Args) -> dict[str, str]:
    return {
        "LLMGW_SIM_SCHEDULER": "step",
        "LLMGW_SIM_LORA_LOAD_TIME": str(a.load_time),
        "LLMGW_SIM_OUTPUT_LEN": "8",
        "LLMGW_SIM_LOAD_TIME": "0.2",
    }


def names(a: Args) -> list[str]:
    return [f"lora-{i:02d}" for i in range(a.adapters)]


def popularity(a: Args) -> list[str]:
    """The adapters, most asked for first (the order ``arrivals`` weighs them in)."""
    order = names(a)
    random.Random(a.seed).shuffle(order)  # popularity not tied to the name
    return order


def arrivals(a: Args) -> list[tuple[float, str]]:
    """(seconds from start, adapter) for every request, the same for both fleets."""
    rng = random.Random(a.seed)
    weights = [1.0 / (k + 1) ** a.zipf for k in range(a.adapters)]
    order = names(a)
    rng.shuffle(order)  # popularity not tied to the name
    out: list[tuple[float, str]] = []
    at = 0.0
    while at < a.warmup + a.duration:
        at += rng.expovariate(a.rate)
        out.append((at, rng.choices(order, weights)[0]))
    return out


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    errors: int = 0
    served_by_holder: int = 0
    measured: int = 0
    loads: int = 0


async def ask(client: httpx.AsyncClient, url: str, adapter: str, n: int) -> float:
    """Stream one completion; the time (monotonic) of its first token."""
    body = {
        "model": adapter,
        "prompt": f"request {n}: tell me about {adapter}",
        "max_tokens": 8,
        "stream": True,
    }
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
        async for line in r.aiter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                return time.monotonic()
    raise RuntimeError("no token")


Send = Callable[[str, int], Awaitable[tuple[float, bool]]]


async def drive(a: Args, send: Send, result: Result) -> float:
    """The arrivals, open loop; ``send(adapter, n)`` gives (time to first token, served
    by a holder). The wall-clock time the measured window began."""
    began = time.monotonic()
    measured_from = time.time() + a.warmup

    async def one(n: int, at: float, adapter: str) -> None:
        await asyncio.sleep(max(0.0, began + at - time.monotonic()))
        try:
            ttft, by_holder = await send(adapter, n)
        except Exception as err:
            result.errors += 1
            if result.errors <= 3:
                print(f"  error: {err}", file=sys.stderr)
            return
        if at >= a.warmup:
            result.measured += 1
            result.ttft.append(ttft)
            result.served_by_holder += by_holder

    await asyncio.gather(*(one(n, at, ad) for n, (at, ad) in enumerate(arrivals(a))))
    return measured_from


# --- round robin with load-on-demand ------------------------------------------------------


@dataclass
class RrEngine:
    url: str
    held: dict[str, float] = field(default_factory=dict)  # adapter -> last used
    loading: dict[str, asyncio.Future[None]] = field(default_factory=dict)
    busy: dict[str, int] = field(default_factory=dict)


def healthy(url: str) -> bool:
    try:
        return http_get(url + "/health")[0] == 200
    except OSError:
        return False


@contextmanager
def rr_fleet(a: Args, workdir: Path) -> Iterator[list[RrEngine]]:
    env = {**engine_env(a), "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "CUDA_VISIBLE_DEVICES": "0"}
    args = ["--enable-lora", "--max-loras", str(a.max_loras), "--max-lora-rank", "16"]
    with ExitStack() as stack:
        engines = []
        for i in range(a.replicas):
            port = free_port()
            proc = Proc(engine_argv("vllm", port, args), log_dir=workdir / f"rr-{i}", env=env)
            stack.enter_context(proc)
            engines.append(RrEngine(f"http://127.0.0.1:{port}"))
        for e in engines:
            wait_for(partial(healthy, e.url), timeout=60, what=f"{e.url} healthy")
        yield engines


async def run_rr(a: Args, engines: list[RrEngine], result: Result) -> None:
    turn = 0
    measured_from = time.monotonic() + a.warmup
    async with httpx.AsyncClient(timeout=180, limits=httpx.Limits(max_connections=1000)) as client:

        async def send(adapter: str, n: int) -> tuple[float, bool]:
            nonlocal turn
            e = engines[turn % len(engines)]
            turn += 1
            began = time.monotonic()
            by_holder = adapter in e.held and adapter not in e.loading
            while adapter not in e.held or adapter in e.loading:
                if adapter in e.loading:
                    await e.loading[adapter]
                    continue
                if len(e.held) >= a.max_loras:
                    idle = [x for x in e.held if not e.busy.get(x) and x not in e.loading]
                    if not idle:
                        await asyncio.sleep(0.01)  # every slot in use: wait for one
                        continue
                    victim = min(idle, key=lambda x: e.held[x])
                    del e.held[victim]
                    r = await client.post(
                        e.url + "/v1/unload_lora_adapter", json={"lora_name": victim}
                    )
                    r.raise_for_status()
                    # Another request may have started this load meanwhile: look again
                    # (two loads of one adapter: the engine refuses the second).
                    continue
                done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                e.loading[adapter] = done
                e.held[adapter] = began
                try:
                    body = {"lora_name": adapter, "lora_path": f"/loras/{adapter}"}
                    r = await client.post(e.url + "/v1/load_lora_adapter", json=body)
                    r.raise_for_status()
                finally:
                    del e.loading[adapter]
                    done.set_result(None)
                if began >= measured_from:
                    result.loads += 1
            e.held[adapter] = time.monotonic()
            e.busy[adapter] = e.busy.get(adapter, 0) + 1
            try:
                first = await ask(client, e.url, adapter, n)
            finally:
                e.busy[adapter] -= 1
            return first - began, by_holder

        await drive(a, send, result)


# --- llmgw ------------------------------------------------------------------------------------


def start_llmgw(a: Args, cluster: Cluster) -> None:
    profile = vllm_profile(
        replicas=a.replicas,
        # Unused for 2 s: a router reports use every 0.5 s (hold.demand_interval below).
        lora={"max_loras": a.max_loras, "max_rank": 16, "min_idle": f"{a.min_idle:g}s"},
        env=engine_env(a),
        load_timeout="120s",
    )
    model = {
        "name": MODEL,
        "profiles": {"default": profile},
        "adapters": [{"name": n, "source": f"/loras/{n}"} for n in names(a)],
    }
    cluster.start_control([model])
    cluster.start_agent("node-a", gpus=a.replicas)
    cluster.start_router(
        hold={"hold_timeout": "120s", "demand_interval": "500ms", "max_held": 10_000}
    )
    cluster.wait_replicas(MODEL, a.replicas, timeout=120)
    cluster.wait_router_models(MODEL, *names(a), timeout=60)


def held_since(cluster: Cluster, since: float) -> int:
    """Requests the router held for want of a holder (released) since ``since`` (epoch s)."""
    count = 0
    (log,) = cluster.logs.glob("router-*.log")
    for line in log.read_text(errors="replace").splitlines():
        if "held request released" not in line:
            continue
        with contextlib.suppress(ValueError, KeyError):
            entry = json.loads(line)
            stamp = dt.datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00"))
            if stamp.timestamp() >= since:
                count += 1
    return count


async def run_llmgw(a: Args, cluster: Cluster, result: Result) -> tuple[float, int]:
    """Run the arrivals through the router: when the measured window began (epoch s) and
    the adapter loads within it."""

    async def loads_after_warmup() -> int:
        await asyncio.sleep(a.warmup)
        return await asyncio.to_thread(lora_loads, cluster)

    async with httpx.AsyncClient(timeout=180, limits=httpx.Limits(max_connections=1000)) as client:

        async def send(adapter: str, n: int) -> tuple[float, bool]:
            began = time.monotonic()
            first = await ask(client, cluster.router_url, adapter, n)
            # Whether it was held is read from the router's log afterwards.
            return first - began, True

        warm = asyncio.create_task(loads_after_warmup())
        measured_from = await drive(a, send, result)
        before = await warm
    return measured_from, lora_loads(cluster) - before


def trace(a: Args, cluster: Cluster, began: float) -> None:
    """Where the llmgw run loses (--trace): per 10 s from the start, the requests held for want
    of a holder and the loads and unloads, each adapter shown by its popularity rank (0 the
    most asked for); read from the router's and the control plane's logs."""
    rank = {name: k for k, name in enumerate(popularity(a))}
    rows: dict[int, dict[str, list[str]]] = {}
    for pattern, events in (
        ("router-*.log", {"held request released": "held"}),
        ("control*.log", {"adapter command sent": "sent", "adapter leaving": "out"}),
    ):
        for log in cluster.logs.glob(pattern):
            for line in log.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError, KeyError):
                    entry = json.loads(line)
                    kind = events.get(entry.get("event", ""))
                    if kind is None:
                        continue
                    if kind == "sent" and entry["kind"] != "load":
                        continue
                    name = entry.get("model") or entry["adapter"]
                    at = dt.datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00"))
                    slot = int((at.timestamp() - began) // 10) * 10
                    note = str(rank.get(name, name))
                    if kind == "held":
                        note += f"({entry['waited']:.1f})"
                    rows.setdefault(slot, {}).setdefault(kind, []).append(note)
    for slot in sorted(rows):
        r = rows[slot]
        print(f"  t={slot:>3}s", file=sys.stderr)
        for kind, what in (("held", "held"), ("sent", "loads"), ("out", "unloads")):
            if r.get(kind):
                print(f"    {what} {len(r[kind])}: {' '.join(r[kind])}", file=sys.stderr)


def lora_loads(cluster: Cluster) -> int:
    loads: int = cluster.status()["lora"]["loads"]
    return loads


def p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def workload_args(parser: argparse.ArgumentParser) -> None:
    """The fleet's slots and the arrivals (shared with lora_offline.py)."""
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--adapters", type=int, default=40)
    parser.add_argument("--rate", type=float, default=8.0, help="requests a second")
    parser.add_argument("--duration", type=float, default=60.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds not measured")
    parser.add_argument("--zipf", type=float, default=1.5, help="Zipf exponent of demand")


def args_of(ns: argparse.Namespace, seed: int, load_time: float) -> Args:
    """The run's Args from what ``workload_args`` parsed."""
    return Args(
        ns.replicas,
        ns.max_loras,
        ns.adapters,
        ns.rate,
        ns.duration,
        ns.warmup,
        ns.zipf,
        load_time,
        seed,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_args(parser)
    parser.add_argument("--load-time", type=float, default=1.0, help="seconds per adapter load")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--min-idle", type=float, default=2.0, help="llmgw: the profile's lora.min_idle (s)"
    )
    parser.add_argument("--only", choices=("both", "llmgw", "rr"), default="both")
    parser.add_argument(
        "--trace", action="store_true", help="llmgw: held requests and loads per 10 s, by rank"
    )
    ns = parser.parse_args(argv)
    a = dataclasses.replace(args_of(ns, ns.seed, ns.load_time), min_idle=ns.min_idle)
    rows: dict[str, dict[str, float]] = {}
    print(f"arrivals: {len(arrivals(a))} requests; {a}", file=sys.stderr)
    rr_name = "round robin + load on demand"
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        work = Path(tmp)
        if ns.only in ("both", "rr"):
            rr = Result()
            with rr_fleet(a, work / "rr") as engines:
                asyncio.run(run_rr(a, engines, rr))
            rows[rr_name] = summary(a, rr, rr.loads)
        if ns.only in ("both", "llmgw"):
            lg = Result()
            with Cluster(work / "llmgw") as cluster:
                start_llmgw(a, cluster)
                measured_from, loads = asyncio.run(run_llmgw(a, cluster, lg))
                held = held_since(cluster, measured_from)
                if ns.trace:
                    trace(a, cluster, measured_from - a.warmup)
            lg.served_by_holder = max(0, lg.measured - held)
            rows["llmgw"] = summary(a, lg, loads)
    if len(rows) == 2:
        rr_row, lg_row = rows[rr_name], rows["llmgw"]
        rows["llmgw / round robin"] = {
            "ttft_p90": round(lg_row["ttft_p90_s"] / max(rr_row["ttft_p90_s"], 1e-9), 3),
            "loads_per_min": round(lg_row["loads_per_min"] / max(rr_row["loads_per_min"], 1e-9), 3),
        }
    print(json.dumps(rows, indent=2))
    return 0


def summary(a: Args, r: Result, loads: int) -> dict[str, float]:
    minutes = a.duration / 60
    return {
        "requests": r.measured,
        "errors": r.errors,
        "ttft_p50_s": round(p(r.ttft, 0.5), 3),
        "ttft_p90_s": round(p(r.ttft, 0.9), 3),
        "loads_per_min": round(loads / minutes, 1),
        "served_by_holder": round(r.served_by_holder / max(1, r.measured), 3),
    }


if __name__ == "__main__":
    sys.exit(main())
