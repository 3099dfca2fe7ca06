"""A rolling update with and without warming (issue 28 point 3): TTFT p90 per 10 s window.

    python tools/bench/bench_warm_drain.py                      # both, alternating
    python tools/bench/bench_warm_drain.py --seconds 100 --min-ready 10 --repeat 2
    python tools/bench/bench_warm_drain.py --only warm --warm-fraction 0.3
    python tools/bench/bench_warm_drain.py --scale-down --seconds 70

The tenants workload of bench_routing (32 tenants, ~2,000-token system prompts, open-loop
Poisson arrivals of streaming chats) on the control fleet (a real ``llmgw-control`` and
``llmgw-agent`` launching 4 step-simulated vLLM engines, one GPU spare for the rollout's
surge) through one llmgw router (cache_aware, fed by the control plane). At
``--rollout-at`` seconds the profile's revision changes (an environment variable of the
engines) and the control plane replaces the 4 replicas one by one (``max_surge`` 1,
``rollout.min_ready`` from ``--min-ready``). ``warm`` runs with
``control.warm_before_drain`` (default 3 s) and the router's warming on
(``warming.max_prefill_fraction`` from ``--warm-fraction``): each replaced replica is
published leaving first, each new one is held until warm, and the router warms the
prefixes' new homes; ``cold`` with 0 and the router's warming off.

Printed per run: TTFT p90 per 10 s window (by send time), the steady p90 (the last
window before the rollout), the worst window's ratio to it, requests over 250 ms per
window and each one from the rollout on (send time, tenant, TTFT), and per window the
engines' prefix-cache hit rate (the warm copies' own prefill included), the router's
picks by reason and its warm copies; the replicas' state changes; the warming's prompt
tokens (the router's ``llmgw_router_warm_prompt_tokens_total``,
which it estimates at 4 prompt bytes a token, turned into the workload's tokens; an upper
bound of the extra prefill, as a warm copy may hit some cache) per replaced replica
against the prompt tokens a replica was sent before the rollout (``vllm:prompt_tokens_total``,
mean per engine), and against the replaced replicas' prompt tokens over their whole life
(what the router's budget is a share of: their last ``cache_aware.window`` requests).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from benchlib import serving, use_uvloop
from llmgw_testkit import free_port, http_get, wait_for
from llmgw_testkit.cluster import Cluster
from routing_fleet import BIN, Fleet, engine_samples, sum_metric
from routing_load import drive
from routing_workloads import MODEL, Shape, arrival_times, make_words, request_bodies

# A time to first token this long is counted slow (a cache miss of a tenant's ~2,000-token
# prompt costs ~450 ms at --time-scale 4; a hit ~80 ms).
SLOW = 0.25


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


# The admin port of the current run's router (its metrics).
ADMINS: list[int] = []


@contextlib.contextmanager
def router_up(
    cluster: Cluster,
    logs: Path,
    warming: bool,
    fraction: float,
    slots: bool = True,
    log_level: str = "info",
) -> Iterator[str]:
    """One llmgw router (cache_aware) fed by the cluster's control plane, its warming on
    or off, ranking by slot or (``slots`` false) by endpoint id; ready once every
    engine's load report has arrived. Yields its base URL."""
    port, admin = free_port(), free_port()
    config = logs / f"router-{port}.yaml"  # JSON is YAML
    config.write_text(
        json.dumps(
            {
                "listen": f"127.0.0.1:{port}",
                "admin_listen": f"127.0.0.1:{admin}",
                "balancer": "cache_aware",
                "workers": 1,
                "warming": {"enabled": warming, "max_prefill_fraction": fraction},
                "cache_aware": {"use_slots": slots},
                "control": {
                    "address": f"127.0.0.1:{cluster.grpc_port}",
                    "router_id": "bench-0",
                    "tls": {"insecure": True},
                },
            }
        )
    )
    argv = [str(BIN / "llmgw-router"), "serve", "--config", str(config), "--log-level", log_level]
    with serving(
        argv,
        health=f"http://127.0.0.1:{admin}/readyz",
        what="llmgw-router",
        log_dir=logs,
        name="router",
        timeout=60,
    ):

        def reporting() -> bool:
            status, body = http_get(f"http://127.0.0.1:{admin}/v1/endpoints", timeout=5)
            eps = json.loads(body)["endpoints"] if status == 200 else []
            return len(eps) >= 4 and all(e.get("load_source") == "engine" for e in eps)

        wait_for(reporting, timeout=60, what="the router: every engine's load report")
        ADMINS[:] = [admin]
        yield f"http://127.0.0.1:{port}"


def watch(cluster: Cluster, start: float, until: float, into: list[dict[str, object]]) -> None:
    """At every 10 s boundary from ``start`` to ``until``: the router's picks by reason,
    its warm copies, and the engines' prefix-cache hits and queries (tokens) since the
    last boundary (an engine gone within a window loses its part of it)."""
    last_picks: dict[str, float] = {}
    last_warm = 0.0
    last_engine: dict[str, tuple[float, float]] = {}
    window = 0
    while True:
        at = start + 10 * window
        if at > until:
            return
        time.sleep(max(0.0, at - time.monotonic()))
        picks: dict[str, float] = {}
        warm = 0.0
        for port in ADMINS:
            samples = engine_samples(f"http://127.0.0.1:{port}")
            for key, value in samples.items():
                if key.startswith("llmgw_router_picks_total{"):
                    reason = key.split('reason="', 1)[1].split('"', 1)[0]
                    picks[reason] = picks.get(reason, 0.0) + value
            warm += sum_metric(samples, "llmgw_router_warm_requests_total")
        engines: dict[str, tuple[float, float]] = {}
        try:
            urls = [str(r["endpoint"]) for r in cluster.replicas(MODEL) if r.get("endpoint")]
        except Exception:  # the control plane busy: this window's engine figures lost
            urls = []
        for url in urls:
            try:
                samples = engine_samples(url)
            except OSError:
                continue
            engines[url] = (
                sum_metric(samples, "vllm:prefix_cache_hits_total"),
                sum_metric(samples, "vllm:prefix_cache_queries_total"),
            )
        if window > 0:
            hits = queries = 0.0
            for url, (h, q) in engines.items():
                h0, q0 = last_engine.get(url, (0.0, 0.0))
                if q < q0:  # another engine on that port since: counted from 0
                    h0 = q0 = 0.0
                hits, queries = hits + h - h0, queries + q - q0
            into.append(
                {
                    "window": f"{10 * (window - 1)}-{10 * window}s",
                    "hit_rate": round(hits / queries, 3) if queries > 0 else None,
                    "engines": len(engines),
                    "warm_copies": warm - last_warm,
                    "picks": {
                        k: v - last_picks.get(k, 0.0)
                        for k, v in sorted(picks.items())
                        if v - last_picks.get(k, 0.0)
                    },
                }
            )
        last_picks, last_warm, last_engine = picks, warm, engines
        window += 1


def timeline(
    cluster: Cluster,
    start: float,
    until: float,
    into: list[tuple[float, str, str]],
    prompt_tokens: dict[str, float],
) -> None:
    """Every 0.5 s: each replica's state, as (seconds, replica, state) when it changes;
    and the last prompt tokens read from each engine in ``prompt_tokens`` (its keys)."""
    seen: dict[str, str] = {}
    while time.monotonic() < until:
        try:
            replicas = cluster.replicas(MODEL)
        except Exception:  # the control plane busy: the next poll
            replicas = []
        at = round(time.monotonic() - start, 1)
        for r in replicas:
            rid, state = str(r["replica_id"]), str(r["state"])
            if seen.get(rid) != state:
                seen[rid] = state
                into.append((at, rid[-6:], state))
            url = str(r.get("endpoint", ""))
            if url in prompt_tokens:
                try:
                    samples = engine_samples(url)
                except OSError:
                    continue
                if samples:
                    prompt_tokens[url] = sum_metric(samples, "vllm:prompt_tokens_total")
        time.sleep(0.5)


def run(warm: bool, args: argparse.Namespace, logs: Path, seed: int) -> dict[str, object]:
    fleet = Fleet(4, args.time_scale, args.kv_blocks)
    shape = Shape()
    rate = args.load * fleet.capacity(shape)
    times = arrival_times(rate, args.seconds, seed)
    bodies = request_bodies("tenants", len(times), seed, shape)
    timings = {"load_interval": "250ms", "warm_before_drain": f"{args.warm if warm else 0}s"}
    workdir = Path(tempfile.mkdtemp(prefix="run-", dir=logs))
    with Cluster(workdir, insecure=True, timings=timings) as cluster:
        profile = fleet.profile()
        profile["rollout"] = {
            "max_surge": 1,
            "max_unavailable": 0,
            "min_ready": f"{args.min_ready}s",
        }
        cluster.start_control([{"name": MODEL, "profiles": {"default": profile}}])
        cluster.start_agent("node-0", gpus=fleet.engines + 1)
        replicas = cluster.wait_replicas(MODEL, fleet.engines, timeout=120)
        engines = sorted(str(r["endpoint"]) for r in replicas)
        with router_up(
            cluster, logs, warm, args.warm_fraction, not args.no_slots, args.router_log_level
        ) as url:
            rolled: dict[str, float] = {}
            before: list[dict[str, float]] = []
            per_window: list[dict[str, object]] = []
            events: list[tuple[float, str, str]] = []
            # The replaced engines' prompt tokens over their whole life, last read.
            lifetime = dict.fromkeys(engines, 0.0)
            start = time.monotonic() + 0.2
            start_unix = time.time() + 0.2

            def mark() -> None:
                time.sleep(max(0.0, start + args.rollout_at - 0.5 - time.monotonic()))
                before.extend(engine_samples(u) for u in engines)

            side = [
                threading.Thread(
                    target=roll, args=(cluster, args.rollout_at, start, rolled, args.scale_down)
                ),
                threading.Thread(target=mark),
                threading.Thread(
                    target=watch, args=(cluster, start, start + args.seconds + 1, per_window)
                ),
                threading.Thread(
                    target=timeline,
                    args=(cluster, start, start + args.seconds, events, lifetime),
                ),
            ]
            for t in side:
                t.start()
            results, _ = asyncio.run(drive([url], bodies, times, 0))
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
    tenant_of = {make_words(f"t{t}", shape.system): f"t{t}" for t in range(shape.tenants)}
    slow: list[tuple[float, str, int]] = []
    for at, ttft, body in zip(times, results, bodies, strict=True):
        if ttft is None:
            failed += 1
            continue
        windows.setdefault(int(at // 10), []).append(ttft)
        if ttft > SLOW and at >= args.rollout_at:
            system = json.loads(body)["messages"][0]["content"]
            slow.append((round(at, 1), tenant_of.get(system, "?"), round(1000 * ttft)))
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
        # The wall clock at the bench's second 0, to line a send time up with the logs.
        "start_unix": round(start_unix, 3),
        "min_ready": args.min_ready,
        "slots": not args.no_slots,
        "warm_fraction": args.warm_fraction,
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
        # Against what the router's budget is a share of: the replaced replicas' prompt
        # tokens over their life (under cache_aware.window requests each, here), the
        # last read before each went away.
        "warm_share_of_replaced_lifetime": round(
            warm_engine_tokens / max(1.0, sum(lifetime.values())), 4
        )
        if not args.scale_down
        else None,
        "warm_share_per_replaced": round(
            warm_engine_tokens / (1 if args.scale_down else 4) / steady_prompt, 4
        )
        if steady_prompt
        else None,
        "replica_states_at_end": states,
        "slow_by_window": {
            f"{10 * w}-{10 * w + 10}s": sum(v > SLOW for v in vs)
            for w, vs in sorted(windows.items())
        },
        # Each slow request from the rollout on: (send time, tenant, TTFT in ms).
        "slow_after_rollout": slow,
        "by_window": per_window,
        "replica_events": events,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--rollout-at", type=float, default=30.0)
    parser.add_argument("--warm", type=float, default=3.0, help="warm_before_drain, seconds")
    parser.add_argument(
        "--min-ready",
        type=float,
        default=0.0,
        help="the profile's rollout.min_ready, seconds (both runs of a pair)",
    )
    parser.add_argument(
        "--warm-fraction",
        type=float,
        default=0.1,
        help="the router's warming.max_prefill_fraction (its default 0.1)",
    )
    parser.add_argument(
        "--only", choices=("warm", "cold"), help="one of the pair (the other's figures apart)"
    )
    parser.add_argument("--load", type=float, default=0.6)
    parser.add_argument("--time-scale", type=float, default=4.0)
    parser.add_argument("--kv-blocks", type=int, default=1536)
    parser.add_argument(
        "--scale-down",
        action="store_true",
        help="instead of the rolling update: 4 -> 3 replicas (only a leaving replica, none joins)",
    )
    parser.add_argument(
        "--no-slots",
        action="store_true",
        help="the router ranks by endpoint id (cache_aware.use_slots false): a replacement "
        "takes a fresh share of every replica's prefixes",
    )
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--router-log-level",
        default="info",
        choices=("debug", "info"),
        help="debug: the router logs each pick (endpoint, reason); with --keep-logs",
    )
    parser.add_argument(
        "--keep-logs", type=Path, help="the processes' logs go here, kept (default: deleted)"
    )
    args = parser.parse_args()
    use_uvloop()
    with contextlib.ExitStack() as stack:
        if args.keep_logs is not None:
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            tmp = str(args.keep_logs)
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-warm-"))
        for rep in range(args.repeat):
            order = (True, False) if rep % 2 == 0 else (False, True)
            for warm in order if args.only is None else (args.only == "warm",):
                row = run(warm, args, Path(tmp), args.seed + rep)
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
