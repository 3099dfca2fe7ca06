"""llmgw-router against the simulator directly and against the Rust `vllm-router`.

    python tools/bench/bench_router.py                      # the full table
    python tools/bench/bench_router.py --seconds 2 --rounds 1 --concurrency 1 64
    python tools/bench/bench_router.py --targets direct llmgw llmgw-hypercorn

One `llmgw-sim vllm serve` with zero simulated delays serves every target, so the
only difference between rows is the proxy in the path. Routers run pinned to one
core (`taskset -c 1`); the simulator and this load generator share core 0. Each
cell (case x concurrency) runs the targets one after the other, `--rounds` times
in alternation, and keeps each target's best round: the machine is shared, and
the best round is the least disturbed one.

Cases: non-streaming chat completions (16 tokens), and 100-token streams read to
`[DONE]`, which the simulator writes token by token (`--stream-itl`, 0.1 ms), so
each stream is 100 chunks for the proxy to relay. Latency is per request, first byte sent to last byte read; "added" is a
target's latency minus direct's at the same percentile.

The peer, `vllm-router`, is looked for at --vllm-router (default
/tmp/vr-venv/bin/vllm-router: `uv venv /tmp/vr-venv && uv pip install -p
/tmp/vr-venv/bin/python vllm-router`); without it that row is skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from benchlib import Run, chat_load, serving, use_uvloop
from llmgw_testkit import free_port

BIN = Path(sys.executable).parent
MODEL = "bench-model"


def _pin(core: str) -> list[str]:
    return ["taskset", "-c", core] if shutil.which("taskset") else []


@contextlib.contextmanager
def process(argv: list[str], health: str, what: str, logs: Path, name: str) -> Iterator[int]:
    with serving(
        argv, health=health, what=what, log_dir=logs, name=name, timeout=60, interval=0.1, grace=15
    ) as proc:
        yield proc.pid


def simulator(port: int, logs: Path, itl: float) -> contextlib.AbstractContextManager[int]:
    argv = [
        *_pin("0"), str(BIN / "llmgw-sim"), "vllm", "serve", MODEL,
        "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", "1024",
        "--sim-load-time", "0", "--sim-itl", str(itl),
    ]  # fmt: skip
    return process(argv, f"http://127.0.0.1:{port}/health", "llmgw-sim", logs, "sim")


def llmgw_router(
    port: int, sim: str, server: str, logs: Path
) -> contextlib.AbstractContextManager[int]:
    admin = free_port()
    config = logs / f"router-{server}.yaml"
    choice = "" if server == "default" else f"server: {server}\n"
    config.write_text(f"{choice}health_checks: {{interval: 5s}}\n")
    argv = [
        *_pin("1"), str(BIN / "llmgw-router"), "serve", "--config", str(config),
        "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}",
        "--endpoint", f"sim={sim}={MODEL}", "--log-level", "warning",
    ]  # fmt: skip
    return process(
        argv, f"http://127.0.0.1:{admin}/readyz", f"llmgw-router ({server})", logs, server
    )


def vllm_router(
    binary: str, port: int, sim: str, logs: Path
) -> contextlib.AbstractContextManager[int]:
    argv = [
        *_pin("1"), binary, "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", sim, "--policy", "round_robin",
        "--prometheus-port", str(free_port()), "--log-level", "warning",
    ]  # fmt: skip
    return process(argv, f"http://127.0.0.1:{port}/health", "vllm-router", logs, "vllm-router")


async def run_cell(
    target: str, base: str, pid: int, *, stream: bool, concurrency: int, seconds: float
) -> Run:
    # The proxy's CPU seconds: robust on a busy machine, where throughput and
    # latency also measure the neighbours. Direct (pid 0) has no proxy.
    pids = {target: pid} if pid else {}
    return await chat_load(
        base, MODEL, stream=stream, concurrency=concurrency, seconds=seconds, pids=pids
    )


def _cpu_us(r: Run, target: str) -> float:
    """The proxy's CPU microseconds per successful request."""
    return r.cpu.get(target, 0.0) / r.ok * 1e6 if r.ok else float("nan")


def _fmt_ms(seconds: float) -> str:
    return f"{seconds * 1000:7.2f}"


def print_table(rows: list[tuple[str, int, dict[str, Run]]], targets: list[str]) -> None:
    print(
        f"{'case':<11} {'conc':>4}  {'target':<16} {'req/s':>8} {'x direct':>8}"
        f" {'p50 ms':>7} {'p99 ms':>7} {'+p50 ms':>7} {'+p99 ms':>7} {'cpu us/req':>10}"
    )
    for case, conc, results in rows:
        direct = results.get("direct")
        for target in targets:
            r = results.get(target)
            if r is None:
                continue
            ratio = f"{r.rps / direct.rps:8.2f}" if direct and direct.rps else f"{'':>8}"
            added50 = _fmt_ms(r.pct(0.5) - direct.pct(0.5)) if direct else ""
            added99 = _fmt_ms(r.pct(0.99) - direct.pct(0.99)) if direct else ""
            errors = f"  ({r.errors} errors)" if r.errors else ""
            cpu = f"{_cpu_us(r, target):10.0f}" if r.cpu.get(target) else f"{'':>10}"
            print(
                f"{case:<11} {conc:>4}  {target:<16} {r.rps:8.0f} {ratio}"
                f" {_fmt_ms(r.pct(0.5))} {_fmt_ms(r.pct(0.99))} {added50} {added99} {cpu}{errors}"
            )
        ours, peer = results.get("llmgw"), results.get("vllm-router")
        if ours and peer and peer.rps:
            print(f"{'':<11} {'':>4}  {'llmgw/vllm-router':<16} {ours.rps / peer.rps:8.2f}")
    print()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=2.0, help="per run")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs per cell")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--case", choices=("all", "full", "stream"), default="all")
    parser.add_argument(
        "--targets",
        nargs="+",
        default=["direct", "llmgw", "vllm-router"],
        choices=[
            "direct",
            "llmgw",
            "llmgw-uvicorn",
            "llmgw-hypercorn",
            "vllm-router",
        ],
    )
    parser.add_argument("--vllm-router", default="/tmp/vr-venv/bin/vllm-router")
    parser.add_argument(
        "--stream-itl",
        type=float,
        default=0.0001,
        help="simulator inter-token latency for the stream case (0: one write per stream)",
    )
    args = parser.parse_args()
    if args.seconds <= 0 or args.rounds < 1 or min(args.concurrency) < 1:
        parser.error("--seconds > 0, --rounds >= 1 and --concurrency >= 1")
    targets = list(args.targets)
    if "vllm-router" in targets and not Path(args.vllm_router).exists():
        print(f"vllm-router not found at {args.vllm_router}: its row is skipped", file=sys.stderr)
        targets.remove("vllm-router")
    # The load generator shares core 0 with the simulator; routers get core 1.
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setaffinity(0, {0})
    use_uvloop()

    cases = [("full", False), ("stream-100", True)]
    if args.case != "all":
        cases = [c for c in cases if (c[1] if args.case == "stream" else not c[1])]
    print(
        f"{os.cpu_count()} CPUs; routers pinned to core 1, simulator and load on core 0;"
        f" {args.seconds:g}s per run, best of {args.rounds} alternating rounds\n"
    )
    rows: list[tuple[str, int, dict[str, Run]]] = []
    for case, stream in cases:
        # Streams: a tiny inter-token latency makes the simulator write every token on
        # its own, so a 100-token stream is 100 chunks for the proxy to pass on.
        itl = args.stream_itl if stream else 0.0
        with (
            tempfile.TemporaryDirectory(prefix="bench-router-") as tmp,
            contextlib.ExitStack() as stack,
        ):
            logs = Path(tmp)
            sim_port = free_port()
            stack.enter_context(simulator(sim_port, logs, itl))
            sim = f"http://127.0.0.1:{sim_port}"
            bases = {"direct": sim}
            pids = {"direct": 0}
            for target in targets:
                port = free_port()
                if target.startswith("llmgw"):
                    # `llmgw` is the default server; the others name theirs.
                    server = target.partition("-")[2] or "default"
                    pids[target] = stack.enter_context(llmgw_router(port, sim, server, logs))
                elif target == "vllm-router":
                    pids[target] = stack.enter_context(
                        vllm_router(args.vllm_router, port, sim, logs)
                    )
                if target != "direct":
                    bases[target] = f"http://127.0.0.1:{port}"
            for conc in args.concurrency:
                best: dict[str, Run] = {}
                for _ in range(args.rounds):
                    for target in targets:
                        r = asyncio.run(
                            run_cell(
                                target,
                                bases[target],
                                pids[target],
                                stream=stream,
                                concurrency=conc,
                                seconds=args.seconds,
                            )
                        )
                        if target not in best or r.rps > best[target].rps:
                            best[target] = r
                rows.append((case, conc, best))
                print_table([rows[-1]], targets)
    return 1 if any(r.errors for _, _, res in rows for r in res.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
