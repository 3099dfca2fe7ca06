"""The router's Prometheus metrics, in a registry of its own.

Label children are cached: `.labels()` costs more than the observation itself,
and the hot path asks for the same few label sets over and over.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

__all__ = ["Metrics"]

# `*_created` series double the output and no dashboard of ours reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]

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
        self.held = Gauge(
            "llmgw_router_held_requests",
            "Requests held for a model scaled to zero, by model.",
            ["model"],
            registry=r,
        )
        self._children: dict[tuple[Any, ...], Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found
