"""bench_routing's results: one run's figures, the per-run table, the medians over the
repeats and the ratios between targets."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from routing_fleet import PRECISE
from routing_workloads import TENANT_WORKLOADS


@dataclass
class Result:
    workload: str
    target: str
    rate: float
    cache: str = "roomy"
    fleet: str = "control"
    sent: int = 0
    ok: int = 0
    errors: int = 0
    ttft: list[float] = field(default_factory=list)
    duration: float = 0.0
    hit_rate: float = 0.0
    per_engine: list[int] = field(default_factory=list)
    per_engine_hit: list[float] = field(default_factory=list)  # each engine's own hit rate
    router_cpu: float = 0.0  # seconds, all router processes, over every request sent
    all_sent: int = 0  # warm-up included
    loadgen_cpu: float = 0.0
    watched: int = 0  # samples of every engine's running/waiting (after the warm-up)
    idle_while_queued: int = 0  # of them: an engine idle while another had requests waiting
    prompt_evaluated: float = math.nan  # llama.cpp: prompt tokens evaluated per request
    loadavg: str = ""  # /proc/loadavg's 1, 5 and 15 minute figures at the run's start
    control_cpu: float = 0.0  # seconds: control plane and agent, over the run (control fleet)
    # llmgw's routers: picks by reason (llmgw_router_picks_total), summed over them.
    reasons: dict[str, int] = field(default_factory=dict)

    def pct(self, q: float) -> float:
        if not self.ttft:
            return math.nan
        data = sorted(self.ttft)
        return data[min(len(data) - 1, int(q * len(data)))]

    @property
    def throughput(self) -> float:
        return self.ok / self.duration if self.duration else 0.0

    @property
    def max_mean(self) -> float:
        mean = statistics.fmean(self.per_engine) if self.per_engine else 0.0
        return max(self.per_engine) / mean if mean else math.nan

    @property
    def cpu_ms_per_request(self) -> float:
        return 1000 * self.router_cpu / self.all_sent if self.all_sent else math.nan

    def row(self) -> dict[str, object]:
        return {
            "workload": self.workload,
            "target": self.target,
            "cache": self.cache,
            "fleet": self.fleet,
            "rate": round(self.rate, 2),
            "sent": self.sent,
            "ok": self.ok,
            "errors": self.errors,
            "ttft_p50_ms": round(1000 * self.pct(0.5), 1),
            "ttft_p90_ms": round(1000 * self.pct(0.9), 1),
            "ttft_p99_ms": round(1000 * self.pct(0.99), 1),
            "throughput": round(self.throughput, 2),
            "hit_rate": round(self.hit_rate, 3),
            "max_mean": round(self.max_mean, 2),
            "per_engine": self.per_engine,
            "per_engine_hit": [round(h, 3) for h in self.per_engine_hit],
            "router_cpu_ms_per_req": round(self.cpu_ms_per_request, 2),
            "loadgen_cpu_share": round(self.loadgen_cpu / self.duration, 2)
            if self.duration
            else None,
            "control_agent_cpu_share": round(self.control_cpu / self.duration, 2)
            if self.duration
            else None,
            "loadavg": self.loadavg,
            "reasons": self.reasons,
            "idle_while_queued": f"{self.idle_while_queued}/{self.watched}",
            "prompt_tokens_evaluated_per_req": None
            if math.isnan(self.prompt_evaluated)
            else round(self.prompt_evaluated, 1),
        }


def fmt(x: float, unit: str = "") -> str:
    return "-" if math.isnan(x) else f"{x:.0f}{unit}" if abs(x) >= 100 else f"{x:.1f}{unit}"


def _hits(r: Result) -> str:
    if math.isnan(r.prompt_evaluated):
        return f"{100 * r.hit_rate:.0f} %"
    return f"{r.prompt_evaluated:.0f} prompt tokens/req"


def table(results: Sequence[Result]) -> str:
    lines = [
        "| workload | cache | fleet | target | req/s offered | TTFT p50 | p90 | p99 | req/s done "
        "| hit rate | max/mean | idle while queued | router CPU/req | errors | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.workload} | {r.cache} | {r.fleet} | {r.target} | {r.rate:.1f} "
            f"| {fmt(1000 * r.pct(0.5), ' ms')} "
            f"| {fmt(1000 * r.pct(0.9), ' ms')} | {fmt(1000 * r.pct(0.99), ' ms')} "
            f"| {r.throughput:.1f} | {_hits(r)} | {r.max_mean:.2f} "
            f"| {r.idle_while_queued}/{r.watched} "
            f"| {fmt(r.cpu_ms_per_request, ' ms')} | {r.errors} | {r.loadavg} |"
        )
    return "\n".join(lines)


def summary(results: Sequence[Result]) -> str:
    """Medians over the repeats, per workload, cache size, fleet and target."""
    groups: dict[tuple[str, str, str, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.workload, r.cache, r.fleet, r.target), []).append(r)
    lines = [
        "| workload | cache | fleet | target | runs | TTFT p50 | p90 | req/s done | hit rate "
        "| max/mean | idle while queued | router CPU/req |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (workload, cache, fleet, target), rs in groups.items():

        def med(values: list[float]) -> float:
            return statistics.median(values)

        idle = med([r.idle_while_queued / r.watched if r.watched else 0.0 for r in rs])
        lines.append(
            f"| {workload} | {cache} | {fleet} | {target} | {len(rs)} "
            f"| {fmt(1000 * med([r.pct(0.5) for r in rs]), ' ms')} "
            f"| {fmt(1000 * med([r.pct(0.9) for r in rs]), ' ms')} "
            f"| {med([r.throughput for r in rs]):.1f} | {100 * med([r.hit_rate for r in rs]):.0f} % "
            f"| {med([r.max_mean for r in rs]):.2f} | {100 * idle:.1f} % "
            f"| {fmt(med([r.cpu_ms_per_request for r in rs]), ' ms')} |"
        )
    return "\n".join(lines)


def ratios(results: Sequence[Result]) -> list[str]:
    def med(workload: str, target: str, key: str) -> float:
        vals = [
            getattr(r, key)() if callable(getattr(r, key)) else getattr(r, key)
            for r in results
            if r.workload == workload and r.target == target
        ]
        return statistics.median(vals) if vals else math.nan

    def p90(workload: str, target: str, q: float = 0.9) -> float:
        vals = [r.pct(q) for r in results if r.workload == workload and r.target == target]
        return statistics.median(vals) if vals else math.nan

    out = []
    ca = "cache_aware"
    a, b = p90("tenants", ca, 0.5), p90("tenants", "round_robin", 0.5)
    if not (math.isnan(a) or math.isnan(b)):
        out.append(f"tenants: TTFT p50 cache_aware / round_robin = {a / b:.2f}")
    for workload, other in (
        ("tenants", "round_robin"),
        ("tenants", "sglang-router"),
        ("tenants", "vllm-router"),
        ("unique", "least_outstanding"),
        ("hot", "round_robin"),
    ):
        a, b = p90(workload, ca), p90(workload, other)
        if not (math.isnan(a) or math.isnan(b)):
            out.append(f"{workload}: TTFT p90 cache_aware / {other} = {a / b:.2f}")
    one = med("tenants", ca, "hit_rate")
    four = med("tenants x4", ca, "hit_rate")
    if not (math.isnan(one) or math.isnan(four)):
        out.append(
            f"tenants x4 routers: hit rate {100 * four:.0f} % vs {100 * one:.0f} % through one"
        )
    cpu_ca = med("tenants", ca, "cpu_ms_per_request")
    cpu_lo = med("tenants", "least_outstanding", "cpu_ms_per_request")
    if not (math.isnan(cpu_ca) or math.isnan(cpu_lo)) and cpu_lo:
        out.append(
            f"tenants: router CPU/request cache_aware / least_outstanding = {cpu_ca / cpu_lo:.2f}"
        )
    for workload in TENANT_WORKLOADS:
        a, b = p90(workload, PRECISE), p90(workload, ca)
        if not (math.isnan(a) or math.isnan(b)):
            out.append(
                f"{workload}: TTFT p90 {PRECISE} / cache_aware = {a / b:.2f}; hit rate "
                f"{100 * med(workload, PRECISE, 'hit_rate'):.0f} % vs "
                f"{100 * med(workload, ca, 'hit_rate'):.0f} %"
            )
    hot = [r for r in results if r.workload == "hot" and r.target == ca]
    if hot:
        out.append(f"hot: cache_aware max/mean requests per engine = {hot[0].max_mean:.2f}")
    return out
