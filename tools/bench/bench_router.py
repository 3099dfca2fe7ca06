"""llmgw-router against the simulator directly and against the Rust routers.

    python tools/bench/bench_router.py                      # the full table
    python tools/bench/bench_router.py --seconds 2 --rounds 1 --concurrency 1 64
    python tools/bench/bench_router.py --targets direct llmgw llmgw-hypercorn
    python tools/bench/bench_router.py --workers-run        # workers 1 against 2

One `llmgw-sim vllm serve` with zero simulated delays serves every target, so the
only difference between rows is the proxy in the path. Routers run pinned to one
core (`taskset -c 1`); the simulator and this load generator share core 0. Each
cell (case x concurrency) runs the targets one after the other, `--rounds` times
in alternation, and keeps each target's best round: the machine is shared, and
the best round is the least disturbed one.

Cases: non-streaming chat completions (16 tokens), and 100-token streams read to
`[DONE]`, which the simulator writes token by token (`--stream-itl`, 0.1 ms), so
each stream is 100 chunks for the proxy to relay. Latency is per request, first
byte sent to last byte read; "added" is a target's latency minus direct's at the
same percentile.

CPU is what the router's processes used (user + system, the whole process tree:
a supervisor and its workers, or a Rust router's threads) per request answered,
and for streams per chunk relayed (a stream's CPU minus one non-streaming
request's, over its 100 chunks). The `x vllm` and `x sglang` columns are llmgw's
CPU over the peer's from the same run: below 1 is cheaper.

The peers, PyPI's `vllm-router` and `sglang-router`, are looked for under
.cache/rust-routers (`uv venv .cache/rust-routers && uv pip install -p
.cache/rust-routers/bin/python vllm-router sglang-router`); a missing one's row is
skipped. Both are given `--policy round_robin` on their one worker.

`--workers-run` compares `workers: 1` with `workers: 2` on this 2-core machine:
the router processes may use both cores (`taskset -c 0,1`) while the simulator and
the load generator are pinned to core 0. So worker 0 and worker 1 each have a core
in principle, but whichever lands on core 0 competes with the load generator and
the simulator; `workers: 1` has the same two cores and uses at most one of them.
The requests/s ratio says how much a second worker buys when there is a spare
core (here only part of one), CPU per request says what the supervisor and the
second event loop cost (they should cost almost nothing).

`--callgrind N` counts instructions instead of seconds: each router (llmgw with
`workers: 1`, and the peers) runs under `valgrind --tool=callgrind` with
instrumentation off, gets warm, then instrumentation is switched on (callgrind_control,
by pid) for N sequential non-streaming requests on one keep-alive connection, and the
user-space instructions of the router's whole process (all threads) are divided by N.
The count repeats to within about 1 % on a busy machine, where CPU seconds vary by
tens of percent; it leaves out the kernel (system calls), and under valgrind a
request takes tens of times longer, so periodic work (timers, health checks) weighs
more than it does at full speed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import benchlib
from benchlib import Run, chat_body, chat_load, serving, use_uvloop
from llmgw_testkit import free_port, http_get

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / ".cache" / "rust-routers" / "bin"
MODEL = "bench-model"
STREAM_TOKENS = 100
PEER_TARGETS = ("vllm-router", "sglang-router")


def _pin(cores: str) -> list[str]:
    return ["taskset", "-c", cores] if shutil.which("taskset") else []


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid``, its threads and its descendants (a supervisor's workers)."""
    total = _process_cpu_seconds(pid)
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
            total += sum(tree_cpu_seconds(int(child)) for child in children)
    return total


# chat_load reads CPU through benchlib.cpu_seconds: make it count whole process trees.
_process_cpu_seconds = benchlib.cpu_seconds
benchlib.cpu_seconds = tree_cpu_seconds


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
    port: int, sim: str, server: str, logs: Path, *, workers: int, cores: str
) -> contextlib.AbstractContextManager[int]:
    admin = free_port()
    config = logs / f"router-{server}-{workers}.yaml"
    choice = "" if server == "default" else f"server: {server}\n"
    # The peers get round_robin; so does llmgw, so that the rows compare the proxies.
    config.write_text(
        f"{choice}workers: {workers}\nbalancer: round_robin\nhealth_checks: {{interval: 5s}}\n"
    )
    argv = [
        *_pin(cores), str(BIN / "llmgw-router"), "serve", "--config", str(config),
        "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}",
        "--endpoint", f"sim={sim}={MODEL}", "--log-level", "warning",
    ]  # fmt: skip
    return process(
        argv, f"http://127.0.0.1:{admin}/readyz", f"llmgw-router ({server})", logs, server
    )


def peer_router(
    target: str, binary: Path, port: int, sim: str, logs: Path, cores: str
) -> contextlib.AbstractContextManager[int]:
    if target == "vllm-router":
        argv = [
            *_pin(cores), str(binary), "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", sim, "--policy", "round_robin",
            "--prometheus-port", str(free_port()), "--log-level", "warning",
        ]  # fmt: skip
    else:
        argv = [
            *_pin(cores), str(binary), "launch", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", sim, "--policy", "round_robin",
            "--prometheus-port", str(free_port()), "--log-level", "warn",
        ]  # fmt: skip
    return process(argv, f"http://127.0.0.1:{port}/health", target, logs, target)


async def run_cell(
    target: str, base: str, pid: int, *, stream: bool, concurrency: int, seconds: float
) -> Run:
    # The proxy's CPU seconds: robust on a busy machine, where throughput and
    # latency also measure the neighbours. Direct (pid 0) has no proxy.
    pids = {target: pid} if pid else {}
    return await chat_load(
        base, MODEL, stream=stream, concurrency=concurrency, seconds=seconds, pids=pids
    )


def _cpu_us(r: Run | None, target: str) -> float:
    """The proxy's CPU microseconds per successful request."""
    if r is None or not r.ok or not r.cpu.get(target):
        return float("nan")
    return r.cpu[target] / r.ok * 1e6


def _fmt_ms(seconds: float) -> str:
    return f"{seconds * 1000:7.2f}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:8.2f}" if a == a and b == b and b else f"{'':>8}"


def _cost(
    results: dict[str, Run],
    target: str,
    conc: int,
    streamed: bool,
    per_request: dict[tuple[int, str], float],
) -> float:
    """CPU µs per request, or for streams per chunk relayed."""
    us = _cpu_us(results.get(target), target)
    if not streamed:
        return us
    return (us - per_request.get((conc, target), 0.0)) / STREAM_TOKENS


def print_table(
    rows: list[tuple[str, int, dict[str, Run]]],
    targets: list[str],
    per_request: dict[tuple[int, str], float],
) -> None:
    """One table per cell; for streams, CPU per chunk uses the same target's
    non-streaming CPU per request at the same concurrency (``per_request``)."""
    print(
        f"{'case':<11} {'conc':>4}  {'target':<16} {'req/s':>8} {'x direct':>8}"
        f" {'p50 ms':>7} {'p99 ms':>7} {'+p50 ms':>7} {'+p99 ms':>7} {'cpu us/req':>10}"
        f" {'us/chunk':>8} {'x vllm':>8} {'x sglang':>8}"
    )
    for case, conc, results in rows:
        direct = results.get("direct")
        streamed = case.startswith("stream")

        for target in targets:
            r = results.get(target)
            if r is None:
                continue
            ratio = f"{r.rps / direct.rps:8.2f}" if direct and direct.rps else f"{'':>8}"
            added50 = _fmt_ms(r.pct(0.5) - direct.pct(0.5)) if direct else ""
            added99 = _fmt_ms(r.pct(0.99) - direct.pct(0.99)) if direct else ""
            errors = f"  ({r.errors} errors)" if r.errors else ""
            us = _cpu_us(r, target)
            cpu = f"{us:10.1f}" if us == us else f"{'':>10}"
            chunk = (
                f"{_cost(results, target, conc, streamed, per_request):8.2f}"
                if streamed and us == us
                else f"{'':>8}"
            )
            peers = ""
            if target.startswith("llmgw") and us == us:
                peers = (
                    _ratio(
                        _cost(results, target, conc, streamed, per_request),
                        _cost(results, "vllm-router", conc, streamed, per_request),
                    )
                    + " "
                    + _ratio(
                        _cost(results, target, conc, streamed, per_request),
                        _cost(results, "sglang-router", conc, streamed, per_request),
                    )
                )
            print(
                f"{case:<11} {conc:>4}  {target:<16} {r.rps:8.0f} {ratio}"
                f" {_fmt_ms(r.pct(0.5))} {_fmt_ms(r.pct(0.99))} {added50} {added99} {cpu}"
                f" {chunk} {peers}{errors}"
            )
    print()


def run_cases(
    args: argparse.Namespace,
    targets: list[str],
    *,
    router_cores: str,
    workers: dict[str, int],
) -> list[tuple[str, int, dict[str, Run]]]:
    cases = [("full", False), (f"stream-{STREAM_TOKENS}", True)]
    if args.case != "all":
        cases = [c for c in cases if (c[1] if args.case == "stream" else not c[1])]
    rows: list[tuple[str, int, dict[str, Run]]] = []
    per_request: dict[tuple[int, str], float] = {}
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
                    # `llmgw` is the default server; `llmgw-hypercorn` names its own;
                    # `llmgw-wN` is the default server with N workers.
                    suffix = target.partition("-")[2]
                    server = suffix if suffix in ("uvicorn", "hypercorn") else "default"
                    pids[target] = stack.enter_context(
                        llmgw_router(
                            port,
                            sim,
                            server,
                            logs,
                            workers=workers.get(target, 1),
                            cores=router_cores,
                        )
                    )
                elif target in PEER_TARGETS:
                    binary = Path(getattr(args, target.replace("-", "_")))
                    pids[target] = stack.enter_context(
                        peer_router(target, binary, port, sim, logs, router_cores)
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
                        # The least disturbed round: the least CPU per request.
                        if target not in best or _cpu_us(r, target) < _cpu_us(best[target], target):
                            best[target] = r
                if not stream:
                    for target in targets:
                        per_request[(conc, target)] = _cpu_us(best.get(target), target)
                rows.append((case, conc, best))
                print_table([rows[-1]], targets, per_request)
    return rows


def _descendants(pid: int) -> list[int]:
    found = [pid]
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
                found += _descendants(int(child))
    return found


def _answers(url: str) -> bool:
    try:
        return http_get(url, timeout=2)[0] == 200
    except OSError:
        return False


def callgrind_target(
    target: str, args: argparse.Namespace, sim: str, logs: Path, requests: int
) -> float:
    """User-space instructions per non-streaming request through ``target``."""
    port, admin = free_port(), free_port()
    out = logs / f"callgrind-{target}"
    if target == "llmgw":
        config = logs / "router-callgrind.yaml"
        config.write_text("workers: 1\nbalancer: round_robin\nhealth_checks: {enabled: false}\n")
        argv = [
            str(BIN / "python"), "-m", "llmgw_router", "serve", "--config", str(config),
            "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}",
            "--endpoint", f"sim={sim}={MODEL}", "--log-level", "warning",
        ]  # fmt: skip
        health = f"http://127.0.0.1:{admin}/readyz"
    else:
        binary = str(getattr(args, target.replace("-", "_")))
        launch = [binary] if target == "vllm-router" else [binary, "launch"]
        level = "warning" if target == "vllm-router" else "warn"
        argv = [
            *launch, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", sim,
            "--policy", "round_robin", "--prometheus-port", str(admin), "--log-level", level,
        ]  # fmt: skip
        health = f"http://127.0.0.1:{port}/health"
    valgrind = [
        "valgrind", "--tool=callgrind", "--instr-atstart=no", "--trace-children=yes",
        f"--callgrind-out-file={out}.%p",
    ]  # fmt: skip
    body = chat_body(MODEL, False)
    log = (logs / f"{target}.log").open("wb")
    proc = subprocess.Popen([*valgrind, *argv], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not _answers(health):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{target} under valgrind did not start; see {log.name}")
            time.sleep(0.5)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

        def one() -> int:
            conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
            answer = conn.getresponse()
            answer.read()
            return answer.status

        # Warm: a router under valgrind may take a while to see its engine healthy.
        deadline = time.monotonic() + 300
        while one() != 200:
            if time.monotonic() > deadline:
                raise SystemExit(f"{target} under valgrind never answered 200")
            time.sleep(1)
        for _ in range(100):
            one()
        pids = [str(pid) for pid in _descendants(proc.pid)]

        def control(*flags: str) -> None:
            for pid in pids:
                subprocess.run(
                    ["callgrind_control", *flags, pid],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    check=False,
                )

        control("-i", "on")
        failed = sum(one() != 200 for _ in range(requests))
        control("-i", "off")
        control("-d")
        conn.close()
        if failed:
            raise SystemExit(f"{target}: {failed} of {requests} requests failed under valgrind")
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    total = 0
    for dump in logs.glob(f"callgrind-{target}.*"):
        for line in dump.read_text(errors="replace").splitlines():
            # A dump's "summary:" may be 0; "totals:" is what it counted.
            if line.startswith("totals:"):
                total += int(line.split()[1])
    return total / requests


def callgrind_run(args: argparse.Namespace, targets: list[str]) -> None:
    if not shutil.which("valgrind"):
        raise SystemExit("--callgrind needs valgrind (apt-get install valgrind)")
    counts: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-router-cg-") as tmp:
        logs = Path(tmp)
        sim_port = free_port()
        with simulator(sim_port, logs, 0.0):
            for target in targets:
                counts[target] = callgrind_target(
                    target, args, f"http://127.0.0.1:{sim_port}", logs, args.callgrind
                )
                print(f"{target:<14} {counts[target]:>10,.0f} instructions per request")
    llmgw = counts.get("llmgw")
    for peer in PEER_TARGETS:
        if llmgw and counts.get(peer):
            print(f"llmgw / {peer}: {llmgw / counts[peer]:.2f}")


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
        default=["direct", "llmgw", "vllm-router", "sglang-router"],
        choices=[
            "direct",
            "llmgw",
            "llmgw-uvicorn",
            "llmgw-hypercorn",
            "vllm-router",
            "sglang-router",
        ],
    )
    parser.add_argument("--vllm-router", default=str(PEERS / "vllm-router"))
    parser.add_argument("--sglang-router", default=str(PEERS / "sglang-router"))
    parser.add_argument(
        "--workers-run",
        action="store_true",
        help="llmgw with workers 1 and 2, router processes on cores 0-1 (see above)",
    )
    parser.add_argument(
        "--callgrind",
        type=int,
        metavar="N",
        default=0,
        help="instructions per non-streaming request under callgrind, N requests (see above)",
    )
    parser.add_argument(
        "--stream-itl",
        type=float,
        default=0.0001,
        help="simulator inter-token latency for the stream case (0: one write per stream)",
    )
    args = parser.parse_args()
    if args.seconds <= 0 or args.rounds < 1 or min(args.concurrency) < 1:
        parser.error("--seconds > 0, --rounds >= 1 and --concurrency >= 1")
    # The load generator shares core 0 with the simulator; routers get core 1.
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setaffinity(0, {0})
    use_uvloop()
    if args.callgrind:
        wanted = [t for t in args.targets if t in ("llmgw", *PEER_TARGETS)]
        present = [
            t for t in wanted if t == "llmgw" or Path(getattr(args, t.replace("-", "_"))).exists()
        ]
        callgrind_run(args, present)
        return 0
    if args.workers_run:
        targets = ["direct", "llmgw-w1", "llmgw-w2"]
        print(
            f"{os.cpu_count()} CPUs; llmgw router processes on cores 0-1, simulator and load on"
            f" core 0; {args.seconds:g}s per run, best of {args.rounds} alternating rounds\n"
        )
        rows = run_cases(args, targets, router_cores="0,1", workers={"llmgw-w1": 1, "llmgw-w2": 2})
        for case, conc, results in rows:
            one, two = results.get("llmgw-w1"), results.get("llmgw-w2")
            if one and two and one.rps:
                print(
                    f"{case:<11} {conc:>4}  workers 2 / workers 1: req/s {two.rps / one.rps:.2f},"
                    f" cpu us/req {_cpu_us(two, 'llmgw-w2') / _cpu_us(one, 'llmgw-w1'):.2f}"
                )
    else:
        targets = list(args.targets)
        for peer in PEER_TARGETS:
            binary = getattr(args, peer.replace("-", "_"))
            if peer in targets and not Path(binary).exists():
                print(f"{peer} not found at {binary}: its row is skipped", file=sys.stderr)
                targets.remove(peer)
        print(
            f"{os.cpu_count()} CPUs; routers pinned to core 1, simulator and load on core 0;"
            f" {args.seconds:g}s per run, best of {args.rounds} alternating rounds\n"
        )
        rows = run_cases(args, targets, router_cores="1", workers={})
    return 1 if any(r.errors for _, _, res in rows for r in res.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
