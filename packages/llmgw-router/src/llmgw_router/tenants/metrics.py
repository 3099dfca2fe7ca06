"""Per-key series (label `key`: the key's name, never its secret) and the queue's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from llmgw_router.metrics import Counter, Histogram

__all__ = ["TenantMetrics"]

_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _QueueLengths:
    """`llmgw_router_queue_length{priority,key}`, read from the queues at scrape time."""

    def __init__(self, read: Callable[[], dict[tuple[str, str], int]]) -> None:
        self._read = read

    def describe(self) -> list[Metric]:
        return [self._family()]

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "llmgw_router_queue_length",
            "Requests held in the fair-share queue (the engines full), by priority and key.",
            labels=["priority", "key"],
        )

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for (band, key), count in sorted(self._read().items()):
            family.add_metric([band, key], count)
        yield family


class TenantMetrics:
    def __init__(
        self, registry: CollectorRegistry, lengths: Callable[[], dict[tuple[str, str], int]]
    ) -> None:
        r = registry
        self.requests = Counter(
            "llmgw_router_key_requests",
            "Requests admitted, by API key name.",
            ["key"],
            registry=r,
        )
        self.tokens = Counter(
            "llmgw_router_key_tokens",
            "Tokens in the engines' usage, by API key name and kind (prompt, completion).",
            ["key", "kind"],
            registry=r,
        )
        self.errors = Counter(
            "llmgw_router_key_errors",
            "Admitted requests that ended in an error status (>= 400), by API key name.",
            ["key"],
            registry=r,
        )
        self.refused = Counter(
            "llmgw_router_key_refused",
            "Requests refused by admission, by API key name and limit (rpm, tpm, "
            "concurrency, budget, too_large, shed, queue_timeout).",
            ["key", "limit"],
            registry=r,
        )
        self.held_seconds = Counter(
            "llmgw_router_key_held_seconds",
            "Seconds requests were held in the fair-share queue, by API key name.",
            ["key"],
            registry=r,
        )
        self.wait = Histogram(
            "llmgw_router_queue_wait_seconds",
            "Time held in the fair-share queue before going to an engine, by priority and key.",
            ["priority", "key"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        registry.register(_QueueLengths(lengths))
        self._children: dict[tuple[Any, ...], Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found
