"""bench_lora's arrivals replayed through the control plane's LoRA rule, on a simulated clock.

    python tools/bench/lora_replay.py                                # Zipf 1.5, 300 s, seeds 1-6
    python tools/bench/lora_replay.py --min-idle 1 2 --true-rates    # a grid, rates known

What `lora_offline.py` leaves out, kept here: an adapter load takes `--load-time` seconds
and its load report 0.3 s more; routers report demand every 0.5 s (the bench's
`hold.demand_interval`), and the control plane plans at each report with
`llmgw_control.lora_plan.plan` and the constants of `llmgw_control.lora` (spare pool,
patience, turn, rate window, unload grace: an adapter chosen to go is hidden from routers
for the grace, then unloaded). Each replica holds at most `--max-loras`; a request whose
adapter no replica shows is held until one does (not served by a holder). Nothing else is
simulated (no batches, no queueing at the engines), so the share it prints is what the
rule gives when the engines are never the bottleneck: bench_lora's real runs came out
within about a point of it, mostly under (0.1 over to 1.2 under; the README has them).

`--true-rates` gives the rule each adapter's rate from the law the arrivals are drawn
from instead of the rates the routers' reports measure: what better measuring could gain.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from collections.abc import Sequence

from bench_lora import Args, args_of, arrivals, popularity, workload_args
from llmgw_control import lora as rule
from llmgw_control.lora_plan import ReplicaView, plan
from prometheus_client import CollectorRegistry


@dataclasses.dataclass(frozen=True)
class Knobs:
    min_idle: float
    spare_share: float
    patience: float
    turn_extra: float
    load_time: float = 1.0
    lag: float = 0.3
    report: float = 0.5
    true_rates: bool = False


def true_rates(a: Args) -> dict[str, float]:
    weights = [1.0 / (k + 1) ** a.zipf for k in range(a.adapters)]
    total = sum(weights)
    return {name: a.rate * w / total for name, w in zip(popularity(a), weights, strict=True)}


def replay(a: Args, k: Knobs, dt: float = 0.05) -> float:
    """The share of the measured requests that found a replica showing their adapter."""
    reqs = arrivals(a)
    rates = true_rates(a)
    manager = rule.LoraManager(CollectorRegistry())
    replicas = range(a.replicas)
    loaded: list[set[str]] = [set() for _ in replicas]
    loading: list[dict[str, float]] = [{} for _ in replicas]  # adapter -> when shown
    leaving: dict[tuple[int, str], float] = {}  # (replica, adapter) -> hidden since
    held: dict[str, int] = {}
    counts: dict[str, int] = {}
    reported: set[str] = set()
    served = measured = 0
    i = 0
    t = 0.0
    next_report = k.report
    end = a.warmup + a.duration
    spare = max(1, int(k.spare_share * a.replicas * a.max_loras))

    def shown(adapter: str) -> bool:
        return any(adapter in loaded[r] and (r, adapter) not in leaving for r in replicas)

    while t < end:
        for r in replicas:
            for adapter, at in list(loading[r].items()):
                if at <= t:
                    del loading[r][adapter]
                    loaded[r].add(adapter)
        for (r, adapter), since in list(leaving.items()):
            if t - since >= rule.UNLOAD_GRACE:
                del leaving[(r, adapter)]
                loaded[r].discard(adapter)
        for adapter in [x for x in held if shown(x)]:
            counts[adapter] = counts.get(adapter, 0) + held.pop(adapter)
        while i < len(reqs) and reqs[i][0] <= t:
            at, adapter = reqs[i]
            i += 1
            measured += at >= a.warmup
            if shown(adapter):
                served += at >= a.warmup
                counts[adapter] = counts.get(adapter, 0) + 1
            else:
                held[adapter] = held.get(adapter, 0) + 1
        if t >= next_report:
            next_report += k.report
            for adapter in reported | set(counts) | set(held):
                manager.on_demand(adapter, held.get(adapter, 0), counts.get(adapter, 0), t)
            reported = set(held)
            counts = {}
            views = [
                ReplicaView(
                    f"r{r}",
                    0.0,
                    a.max_loras,
                    frozenset(loaded[r] - {x for (q, x) in leaving if q == r}),
                    frozenset(loading[r]),
                )
                for r in replicas
            ]
            demand = {x: d.view(t, manager.since) for x, d in manager.demand.items()}
            if k.true_rates:
                demand = {x: dataclasses.replace(d, rate=rates[x]) for x, d in demand.items()}
            for action in plan(
                views,
                demand,
                now=t,
                min_idle=k.min_idle,
                patience=k.patience,
                spare=spare,
                turn=k.min_idle + k.turn_extra,
            ):
                r = int(action.replica[1:])
                key = (r, action.adapter)
                if action.kind == "unload":
                    leaving[key] = t
                elif key in leaving:
                    del leaving[key]  # wanted again where it is still loaded
                else:
                    loading[r][action.adapter] = t + k.load_time + k.lag
        t += dt
    return served / max(1, measured)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_args(parser)
    parser.set_defaults(duration=300.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--load-time", type=float, default=1.0)
    parser.add_argument("--min-idle", type=float, nargs="+", default=[2.0])
    parser.add_argument("--spare-share", type=float, nargs="+", default=[rule.SPARE_SHARE])
    parser.add_argument("--patience", type=float, nargs="+", default=[rule.PATIENCE])
    parser.add_argument("--turn-extra", type=float, nargs="+", default=[rule.TURN_EXTRA])
    parser.add_argument(
        "--rate-window",
        type=float,
        default=rule.RATE_WINDOW,
        help="seconds an adapter's rate is counted over (llmgw_control.lora.RATE_WINDOW)",
    )
    parser.add_argument("--true-rates", action="store_true")
    ns = parser.parse_args(argv)
    rule.RATE_WINDOW = ns.rate_window
    print(
        f"Zipf {ns.zipf}, {ns.adapters} adapters, {ns.replicas} x {ns.max_loras} slots, "
        f"{ns.rate}/s, {ns.duration:g} s after a {ns.warmup:g} s warm-up: requests that "
        "found a holder"
    )
    print(
        "| min_idle | spare share | patience | turn extra | "
        + " | ".join(f"seed {s}" for s in ns.seeds)
        + " |"
    )
    print("|---|---|---|---|" + "---|" * len(ns.seeds))
    for mi, sp, pa, te in itertools.product(
        ns.min_idle, ns.spare_share, ns.patience, ns.turn_extra
    ):
        k = Knobs(mi, sp, pa, te, load_time=ns.load_time, true_rates=ns.true_rates)
        shares = [replay(args_of(ns, s, ns.load_time), k) for s in ns.seeds]
        cells = " | ".join(f"{x * 100:.1f} %" for x in shares)
        print(f"| {mi:g} s | {sp:g} | {pa:g} s | {te:g} s | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
