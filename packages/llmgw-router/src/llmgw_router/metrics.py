"""The router's Prometheus metrics, in a registry of its own.

Counters and histograms are this module's own lean collectors rather than
prometheus-client's: a router process is one thread (one event loop), so they
need no lock, and a histogram finds its bucket by bisection. prometheus-client's
`Counter.inc` cost about 3 µs and `Histogram.observe` about 6 µs under load here
(its lock, its observability checks, a Python loop over the buckets); these cost
about a tenth of that, and a streamed chunk observes one. The exposition is the
same. Gauges (set at scrape time) stay prometheus-client's.

Label children are cached: `.labels()` costs more than the observation itself,
and the hot path asks for the same few label sets over and over.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, disable_created_metrics
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    HistogramMetricFamily,
    Metric,
)

__all__ = ["Counter", "Histogram", "Metrics"]

# `*_created` series double the output and no dashboard of ours reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]


class _CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        self.value += amount


class _HistogramChild:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        # Per bucket, not cumulative: the last one is +Inf.
        self.counts = [0] * len(bounds)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        # The first bound >= amount: Prometheus buckets are `le`.
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount


class _Family:
    """What both lean collectors share: label children, and registration."""

    kind = ""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], Any] = {}
        if not self.labelnames:
            self._children[()] = self._new()
        if registry is not None:
            registry.register(self)  # type: ignore[arg-type]

    def _new(self) -> Any:
        raise NotImplementedError

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
            child = self._children[values] = self._new()
        return child

    def samples(self) -> list[tuple[tuple[str, ...], Any]]:
        """(label values, value): a counter's number, a histogram's per-bucket counts."""
        return [
            (values, child.value if isinstance(child, _CounterChild) else list(child.counts))
            for values, child in self._children.items()
        ]

    def clear(self) -> None:
        self._children.clear()
        if not self.labelnames:
            self._children[()] = self._new()

    def describe(self) -> list[Metric]:
        return [self._family()]

    def _family(self) -> Metric:
        raise NotImplementedError


class Counter(_Family):
    """A counter for one thread: ``.labels(*values).inc(amount)``."""

    def _new(self) -> _CounterChild:
        return _CounterChild()

    def inc(self, amount: float = 1.0) -> None:
        self._children[()].inc(amount)

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for values, child in self._children.items():
            family.add_metric(list(values), child.value)
        yield family


class Histogram(_Family):
    """A histogram for one thread: ``.labels(*values).observe(amount)``."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry | None = None,
    ) -> None:
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.bounds = bounds
        super().__init__(name, documentation, labelnames, registry=registry)

    def _new(self) -> _HistogramChild:
        return _HistogramChild(self.bounds)

    def observe(self, amount: float) -> None:
        self._children[()].observe(amount)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for values, child in self._children.items():
            running = 0
            buckets = []
            for bound, count in zip(self.bounds, child.counts, strict=True):
                running += count
                buckets.append((_le(bound), running))
            family.add_metric(list(values), buckets, child.sum)
        yield family


def _le(bound: float) -> str:
    # The same spelling as prometheus-client's: "0.005", "1.0", "+Inf".
    if bound == math.inf:
        return "+Inf"
    return repr(float(bound))


# The reasons of llmgw_router_upstream_errors_total exported at 0 for every endpoint.
UPSTREAM_REASONS = (
    "connect",
    "reset",
    "timeout_first_byte",
    "timeout_idle",
    "status_429",
    "status_5xx",
)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "llmgw_router_requests",
            "Requests answered, by model, HTTP status and the endpoint that served them.",
            ["model", "status", "endpoint"],
            registry=r,
        )
        self.duration = Histogram(
            "llmgw_router_request_duration_seconds",
            "Time from request to the last byte of the response.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "llmgw_router_time_to_first_token_seconds",
            "Time from request to the engine's first body byte.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.gap = Histogram(
            "llmgw_router_inter_chunk_gap_seconds",
            "Time between consecutive chunks of a streamed response.",
            ["model"],
            buckets=_GAP_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "llmgw_router_tokens",
            "Tokens reported in the engines' usage, by model and kind (prompt, completion).",
            ["model", "kind"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "llmgw_router_upstream_errors",
            "Failed upstream attempts, by endpoint and reason.",
            ["endpoint", "reason"],
            registry=r,
        )
        self.retries = Counter(
            "llmgw_router_retries", "Attempts retried on another endpoint.", ["model"], registry=r
        )
        self.retries_denied = Counter(
            "llmgw_router_retries_denied",
            "Retries not made because the retry budget was spent.",
            ["model"],
            registry=r,
        )
        self.resumes = Counter(
            "llmgw_router_resumes",
            "Streams resumed on another replica after their engine broke off.",
            ["model"],
            registry=r,
        )
        self.resume_failures = Counter(
            "llmgw_router_resume_failures",
            "Broken streams not resumed (ended with the error event), by reason.",
            ["model", "reason"],
            registry=r,
        )
        self.warm_requests = Counter(
            "llmgw_router_warm_requests",
            "Prefill-only requests sent to warm a leaving endpoint's new homes, by outcome.",
            ["model", "outcome"],
            registry=r,
        )
        self.warm_tokens = Counter(
            "llmgw_router_warm_prompt_tokens",
            "Prompt tokens (estimated) of the warming requests.",
            ["model"],
            registry=r,
        )
        # Disaggregated models (proxy/disagg.py, issue 32).
        self.disagg_phase = Histogram(
            "llmgw_router_disagg_phase_seconds",
            "A disaggregated request's phases: prefill (the prefill engine's answer), "
            "transfer (decode request to its first byte: KV fetch and first step), "
            "decode (first byte to the end).",
            ["model", "phase"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.disagg_pairs = Counter(
            "llmgw_router_disagg_pairs",
            "Prefill/decode pairs that served a request, by both endpoints.",
            ["model", "prefill", "decode"],
            registry=r,
        )
        self.disagg_prefill_retries = Counter(
            "llmgw_router_disagg_prefill_retries",
            "Prefill attempts made again (on another prefill endpoint) after one failed.",
            ["model"],
            registry=r,
        )
        self.disagg_local = Counter(
            "llmgw_router_disagg_local",
            "Requests of a disaggregated model sent to a decode engine alone (prompt "
            "under disagg.min_prompt_tokens).",
            ["model"],
            registry=r,
        )
        self.ejections = Counter(
            "llmgw_router_ejections", "Outlier ejections, by endpoint.", ["endpoint"], registry=r
        )
        self.in_flight = Gauge(
            "llmgw_router_in_flight", "Requests in flight, by endpoint.", ["endpoint"], registry=r
        )
        self.client_disconnects = Counter(
            "llmgw_router_client_disconnects",
            "Requests whose client went away before the response ended.",
            ["model"],
            registry=r,
        )
        self.endpoints = Gauge(
            "llmgw_router_endpoints", "Endpoints known, by state.", ["state"], registry=r
        )
        self.snapshot_version = Gauge(
            "llmgw_router_snapshot_version", "Version of the endpoint snapshot in use.", registry=r
        )
        # Routing that sees the engines (filled in at scrape time from the endpoints).
        self.panics = Counter(
            "llmgw_router_panics",
            "Picks made in panic mode (too few usable endpoints: ejection ignored), by model.",
            ["model"],
            registry=r,
        )
        self.picks = Counter(
            "llmgw_router_picks",
            "Endpoint picks, by model and the balancer's reason (holder, rendezvous, "
            "capacity, predicted_ttft, hot_spread, bound_spill, ...; panic_ prefixed in "
            "panic mode).",
            ["model", "reason"],
            registry=r,
        )
        self.engine_running = Gauge(
            "llmgw_router_engine_running",
            "Requests running on the engine, as it last reported (absent when unknown).",
            ["endpoint"],
            registry=r,
        )
        self.engine_waiting = Gauge(
            "llmgw_router_engine_waiting",
            "Requests waiting on the engine, as it last reported (absent when unknown).",
            ["endpoint"],
            registry=r,
        )
        self.engine_kv_cache_usage = Gauge(
            "llmgw_router_engine_kv_cache_usage",
            "The engine's KV-cache use (0..1), as it last reported (absent when unknown).",
            ["endpoint"],
            registry=r,
        )
        self.endpoint_load = Gauge(
            "llmgw_router_endpoint_load",
            "The load the balancer weighs: engine running+waiting+KV use plus this router's "
            "requests since that report, or this router's in-flight count when unknown.",
            ["endpoint", "source"],
            registry=r,
        )
        self.load_updates = Counter(
            "llmgw_router_load_updates",
            "Load updates received from the control plane.",
            registry=r,
        )
        self.prompts_tokenized = Counter(
            "llmgw_router_prompts_tokenized",
            "Prompts tokenized for precise prefix matching (cache_aware.tokenizers).",
            registry=r,
        )
        self.token_cache_tokens = Counter(
            "llmgw_router_token_cache_tokens",
            "Prompt tokens for precise matching, by source: cache (a prefix tokenized "
            "before) or encoded (tokenized for this request).",
            ["source"],
            registry=r,
        )
        self.token_cache_bytes = Gauge(
            "llmgw_router_token_cache_bytes",
            "Bytes held by the cache of prompt segments' tokens (cache_aware.token_cache_bytes).",
            registry=r,
        )
        self.held = Gauge(
            "llmgw_router_held_requests",
            "Requests held for a model scaled to zero, by model.",
            ["model"],
            registry=r,
        )
        self._children: dict[tuple[Any, ...], Any] = {}

    def declare(self, models: Iterable[str], endpoints: Iterable[str]) -> None:
        """Error counters at 0 for every model and endpoint known, before their first
        event: a dashboard panel or an alert over them reads 0, not "No data"."""
        for model in models:
            for family in (self.retries, self.retries_denied, self.client_disconnects):
                self.child(family, model)
        for endpoint in endpoints:
            self.child(self.ejections, endpoint)
            for reason in UPSTREAM_REASONS:
                self.child(self.upstream_errors, endpoint, reason)

    def child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found
