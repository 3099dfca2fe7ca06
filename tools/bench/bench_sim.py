"""Requests/s one llmgw-sim process serves with zero simulated delays.

    python tools/bench/bench_sim.py                 # starts its own simulator
    python tools/bench/bench_sim.py --with-router   # also through llmgw-router, with ratios
    python tools/bench/bench_sim.py --url http://127.0.0.1:8000 --model m   # any endpoint

Two cases at concurrency 64 over loopback, each a few seconds: non-streaming
chat completions, and 100-token streamed chat completions (read to [DONE]).
The simulator must not be what limits a router benchmark: with --with-router
the same load also goes through llmgw-router in front of the simulator.

Besides requests/s it reports the CPU time each process spends per request
(from /proc): on a shared machine requests/s swing with the neighbours' load,
while CPU per request does not, so "router CPU / simulator CPU per request" is
how many times the router's rate one simulator process can carry.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from benchlib import chat_load, serving, use_uvloop
from llmgw_testkit import free_port


@dataclass
class Result:
    name: str
    target: str
    requests: int
    errors: int
    seconds: float
    # CPU seconds per request, by process ("simulator", "router").
    cpu_per_request: dict[str, float] = field(default_factory=dict)

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


@contextlib.contextmanager
def simulator(model: str, logs: Path) -> Iterator[tuple[str, int]]:
    port = free_port()
    argv = [
        sys.executable, "-m", "llmgw_sim", "vllm", "serve", model,
        "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", "1024",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    with serving(
        argv, health=url + "/health", what="simulator", log_dir=logs, name="sim", env=env
    ) as proc:
        yield url, proc.pid


@contextlib.contextmanager
def router(upstream: str, model: str, logs: Path) -> Iterator[tuple[str, int]]:
    port, admin = free_port(), free_port()
    script = os.path.join(os.path.dirname(sys.executable), "llmgw-router")
    argv = [
        script, "serve", "--listen", f"127.0.0.1:{port}", "--admin-listen",
        f"127.0.0.1:{admin}", "--endpoint", f"sim={upstream}={model}",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with serving(
        argv, health=url + "/v1/models", what="llmgw-router", log_dir=logs, name="router"
    ) as proc:
        yield url, proc.pid


async def run_case(
    name: str,
    target: str,
    base: str,
    model: str,
    *,
    stream: bool,
    concurrency: int,
    seconds: float,
    pids: dict[str, int],
) -> Result:
    run = await chat_load(
        base, model, stream=stream, concurrency=concurrency, seconds=seconds, pids=pids
    )
    done = max(1, run.ok + run.errors)
    return Result(
        name, target, run.ok, run.errors, run.seconds, {k: v / done for k, v in run.cpu.items()}
    )


async def measure(
    args: argparse.Namespace, targets: dict[str, str], pids: dict[str, int]
) -> dict[str, list[Result]]:
    """Best of ``--repeat`` runs per target and case; targets take turns so a busy
    neighbour on a shared machine slows them alike."""
    cases = (("non-streaming", False), ("stream 100 tokens", True))
    best: dict[str, list[Result]] = {label: [] for label in targets}
    for name, stream in cases:
        if args.case != "all" and (args.case == "stream") != stream:
            continue
        runs: dict[str, Result] = {}
        for _ in range(args.repeat):
            for label, url in targets.items():
                watched = {k: v for k, v in pids.items() if label == "router" or k != "router"}
                r = await run_case(
                    name,
                    label,
                    url,
                    args.model,
                    stream=stream,
                    concurrency=args.concurrency,
                    seconds=args.seconds,
                    pids=watched,
                )
                if label not in runs or r.rps > runs[label].rps:
                    runs[label] = r
        for label in targets:
            best[label].append(runs[label])
    return best


def _cpu_text(r: Result) -> str:
    parts = [f"{k} {v * 1e6:.0f} us" for k, v in r.cpu_per_request.items()]
    return f"  CPU/request: {', '.join(parts)}" if parts else ""


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--url", help="benchmark this endpoint instead of starting a simulator")
    parser.add_argument("--model", default="bench-model")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=4.0, help="per case")
    parser.add_argument("--repeat", type=int, default=1, help="runs per case; the best counts")
    parser.add_argument(
        "--with-router", action="store_true", help="also measure through llmgw-router"
    )
    parser.add_argument("--case", choices=("all", "full", "stream"), default="all")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    args = parser.parse_args()
    if args.concurrency < 1 or args.seconds <= 0 or args.repeat < 1:
        parser.error("--concurrency and --repeat must be >= 1, --seconds > 0")
    use_uvloop()
    with contextlib.ExitStack() as stack:
        # Each started process writes its output here; an early exit prints its tail.
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-sim-")))
        pids: dict[str, int] = {}
        if args.url:
            url = args.url
        else:
            url, pids["simulator"] = stack.enter_context(simulator(args.model, logs))
        targets = {"direct": url}
        if args.with_router:
            targets["router"], pids["router"] = stack.enter_context(router(url, args.model, logs))
        best = asyncio.run(measure(args, targets, pids))
    results = [r for rs in best.values() for r in rs]
    if args.json:
        print(json.dumps([{**r.__dict__, "rps": round(r.rps, 1)} for r in results]))
        return 1 if any(r.errors for r in results) else 0
    what = args.url or "llmgw-sim vllm (zero delays)"
    repeat = f", best of {args.repeat}" if args.repeat > 1 else ""
    print(f"target: {what}, concurrency {args.concurrency}, {args.seconds:g} s per case{repeat}")
    for r in best["direct"]:
        print(f"  {r.name:<18} {r.rps:9.1f} req/s  ({r.errors} errors){_cpu_text(r)}")
    if "router" in best:
        print("through llmgw-router:")
        for direct, r in zip(best["direct"], best["router"], strict=True):
            print(f"  {r.name:<18} {r.rps:9.1f} req/s  ({r.errors} errors){_cpu_text(r)}")
            sim_cpu = direct.cpu_per_request.get("simulator", 0.0)
            router_cpu = r.cpu_per_request.get("router", 0.0)
            if sim_cpu > 0:
                print(
                    f"    {'':<16} simulator/router requests/s {direct.rps / max(r.rps, 1e-9):.1f}x;"
                    f" router/simulator CPU per request {router_cpu / sim_cpu:.1f}x"
                )
    return 1 if any(r.errors for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
