"""A rolling update with and without warming (issue 28 point 3): TTFT p90 per 10 s window.

    python tools/bench/bench_warm_drain.py                      # both, alternating
    python tools/bench/bench_warm_drain.py --seconds 90 --rollout-at 30 --repeat 2

The tenants workload of bench_routing (32 tenants, ~2,000-token system prompts, open-loop
Poisson arrivals of streaming chats) on the control fleet (a real ``llmgw-control`` and
``llmgw-agent`` launching 4 step-simulated vLLM engines, one GPU spare for the rollout's
surge) through one llmgw router (cache_aware, fed by the control plane). At
``--rollout-at`` seconds the profile's revision changes (an environment variable of the
engines) and the control plane replaces the 4 replicas one by one. ``warm`` runs with
``control.warm_before_drain`` (default 3 s): each replaced replica is published leaving
first and the router warms its prefixes' new homes; ``cold`` with 0 (drained at once,
nothing warmed).

Printed per run: TTFT p90 per 10 s window (by send time), the steady p90 (the last
window before the rollout), the worst window's ratio to it, and the warming's
prompt tokens (the router's ``llmgw_router_warm_prompt_tokens_total``, which it estimates
at 4 prompt bytes a token, turned into the workload's tokens; an upper bound of the extra
prefill, as a warm copy may hit some cache) per replaced replica against the prompt
tokens a replica was sent before the rollout (its recent prefill work:
``vllm:prompt_tokens_total``, mean per engine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchlib import use_uvloop
from llmgw_testkit.cluster import Cluster
from routing_fleet import ADMINS, Fleet, engine_samples, router_up, sum_metric
from routing_load import drive
from routing_workloads import MODEL, Shape, arrival_times, make_words, request_bodies


def p90(values: list[float]) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]


def roll(
    cluster: Cluster, at: float, start: float, done: dict[str, float], scale_down: bool
) -> None:
    """At ``start + at``: a new revision of the profile (the engines' environment), or
    with ``scale_down`` one replica fewer."""
    time.sleep(max(0.0, start + at - time.monotonic()))
    path = cluster.workdir / "control.yaml"
    config = json.loads(path.read_text())
    profile = config["models"][0]["profiles"]["default"]
    if scale_down:
        profile["replicas"] -= 1
    else:
        profile["env"]["LLMGW_SIM_REVISION"] = "2"
    path.write_text(json.dumps(config, indent=2))
    assert cluster.control is not None
    done["sent"] = time.monotonic() - start
    cluster.control.signal(signal.SIGHUP)


def run(warm: bool, args: argparse.Namespace, logs: Path, seed: int) -> dict[str, object]:
    fleet = Fleet(4, args.time_scale, args.kv_blocks)
    shape = Shape()
    rate = args.load * fleet.capacity(shape)
    times = arrival_times(rate, args.seconds, seed)
    bodies = request_bodies("tenants", len(times), seed, shape)
    timings = {"load_interval": "250ms", "warm_before_drain": f"{args.warm if warm else 0}s"}
    workdir = Path(tempfile.mkdtemp(prefix="run-", dir=logs))
    with Cluster(workdir, insecure=True, timings=timings) as cluster:
        cluster.start_control([{"name": MODEL, "profiles": {"default": fleet.profile()}}])
        cluster.start_agent("node-0", gpus=fleet.engines + 1)
        replicas = cluster.wait_replicas(MODEL, fleet.engines, timeout=120)
        engines = sorted(str(r["endpoint"]) for r in replicas)
        ADMINS.clear()
        with router_up("cache_aware", engines, logs, 1, cluster) as (urls, _pids):
            rolled: dict[str, float] = {}
            before: list[dict[str, float]] = []
            start = time.monotonic() + 0.2

            def mark() -> None:
                time.sleep(max(0.0, start + args.rollout_at - 0.5 - time.monotonic()))
                before.extend(engine_samples(u) for u in engines)

            side = [
                threading.Thread(
                    target=roll, args=(cluster, args.rollout_at, start, rolled, args.scale_down)
                ),
                threading.Thread(target=mark),
            ]
            for t in side:
                t.start()
            results, _ = asyncio.run(drive(urls, bodies, times, 0))
            for t in side:
                t.join()
            warm_tokens = warm_requests = 0.0
            for port in ADMINS:
                samples = engine_samples(f"http://127.0.0.1:{port}")
                warm_tokens += sum_metric(samples, "llmgw_router_warm_prompt_tokens_total")
                warm_requests += sum_metric(samples, "llmgw_router_warm_requests_total")
        states = [r["state"] for r in cluster.replicas(MODEL)]
    windows: dict[int, list[float]] = {}
    failed = 0
    for at, ttft in zip(times, results, strict=True):
        if ttft is None:
            failed += 1
            continue
        windows.setdefault(int(at // 10), []).append(ttft)
    roll_window = int(args.rollout_at // 10)
    # Steady: the last window before the rollout (the 32 tenants' caches fill in ~20 s).
    steady = windows.get(roll_window - 1, [])
    steady_p90 = p90(steady)
    after = {w: p90(vs) for w, vs in sorted(windows.items()) if w >= roll_window}
    # The router estimates a prompt's tokens at 4 bytes each; this workload's tokens are
    # words (the simulator counts words): the warm copies' tokens in the engines' terms.
    sample = make_words("t10", shape.system)
    warm_engine_tokens = warm_tokens * 4 / ((len(sample) + 1) / shape.system)
    steady_prompt = sum(sum_metric(s, "vllm:prompt_tokens_total") for s in before) / max(
        1, len(before)
    )
    return {
        "warm": warm,
        "rate": round(rate, 2),
        "sent": len(times),
        "failed": failed,
        "steady_p90_ms": round(1000 * steady_p90, 1),
        "p90_ms_by_window": {
            f"{10 * w}-{10 * w + 10}s": round(1000 * p90(vs), 1)
            for w, vs in sorted(windows.items())
        },
        "worst_ratio": round(max(after.values()) / steady_p90, 2) if after else None,
        "warm_requests": warm_requests,
        "warm_prompt_tokens_router_estimate": warm_tokens,
        "warm_prompt_tokens": round(warm_engine_tokens),
        "prompt_tokens_per_engine_before_rollout": steady_prompt,
        "warm_share_per_replaced": round(
            warm_engine_tokens / (1 if args.scale_down else 4) / steady_prompt, 4
        )
        if steady_prompt
        else None,
        "replica_states_at_end": states,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--rollout-at", type=float, default=30.0)
    parser.add_argument("--warm", type=float, default=3.0, help="warm_before_drain, seconds")
    parser.add_argument("--load", type=float, default=0.6)
    parser.add_argument("--time-scale", type=float, default=4.0)
    parser.add_argument("--kv-blocks", type=int, default=1536)
    parser.add_argument(
        "--scale-down",
        action="store_true",
        help="instead of the rolling update: 4 -> 3 replicas (only a leaving replica, none joins)",
    )
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    use_uvloop()
    with tempfile.TemporaryDirectory(prefix="bench-warm-") as tmp:
        for rep in range(args.repeat):
            for warm in (True, False) if rep % 2 == 0 else (False, True):
                row = run(warm, args, Path(tmp), args.seed + rep)
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
