"""The supervisor's `/metrics`: the workers' expositions summed.

Counters and histograms add up, and a dead worker's last counts stay in the totals so
they never go backwards; gauges that count per worker (SUMMED_GAUGES) add up, every
other gauge describes the fleet and is shown once (the highest value).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["SUMMED_GAUGES", "MetricsMerger", "parse_metrics", "per_worker"]

# Gauges that count something per worker and add up; every other gauge describes the
# fleet (endpoint states, snapshot version, engine load), is the same in every worker
# and is shown once (the highest value).
SUMMED_GAUGES = frozenset(
    {
        "llmgw_router_in_flight",
        "llmgw_router_held_requests",
        "llmgw_router_token_cache_bytes",
        # Tenants: requests held in each worker's fair-share queue.
        "llmgw_router_queue_length",
    }
)

_SampleKey = tuple[str, str, tuple[tuple[str, str], ...]]
_ADDED = frozenset({"counter", "histogram", "summary", "gaugehistogram", "untyped", "unknown"})


def parse_metrics(text: str) -> tuple[dict[str, tuple[str, str]], dict[_SampleKey, float]]:
    """Families (name: type, help) and samples ((family, sample, labels): value)."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, tuple[str, str]] = {}
    values: dict[_SampleKey, float] = {}
    for family in text_string_to_metric_families(text):
        families[family.name] = (family.type, family.documentation)
        for s in family.samples:
            values[(family.name, s.name, tuple(sorted(s.labels.items())))] = s.value
    return families, values


class MetricsMerger:
    """Sums the workers' metrics; a dead worker's last counts stay in the totals."""

    def __init__(self) -> None:
        self.families: dict[str, tuple[str, str]] = {}
        self._retired: dict[_SampleKey, float] = {}
        # Per worker pid: its last scrape (counters and histograms only).
        self._last: dict[int, dict[_SampleKey, float]] = {}

    def _added(self, key: _SampleKey) -> bool:
        return self.families.get(key[0], ("untyped", ""))[0] in _ADDED

    def retire(self, pid: int) -> None:
        """``pid`` has exited: its last counts are kept for good."""
        for key, value in self._last.pop(pid, {}).items():
            self._retired[key] = self._retired.get(key, 0.0) + value

    def merge(self, scrapes: dict[int, str]) -> dict[_SampleKey, float]:
        """The fleet's samples from one text exposition per live worker pid."""
        out: dict[_SampleKey, float] = {}
        for pid, text in scrapes.items():
            families, values = parse_metrics(text)
            self.families.update(families)
            self._last[pid] = {k: v for k, v in values.items() if self._added(k)}
            for key, value in values.items():
                if key not in out:
                    out[key] = value
                elif self._added(key) or key[0] in SUMMED_GAUGES:
                    out[key] += value
                else:
                    out[key] = max(out[key], value)
        for key, value in self._retired.items():
            out[key] = out.get(key, 0.0) + value
        return out

    def render(self, samples: dict[_SampleKey, float], extra: Iterable[Any] = ()) -> bytes:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.metrics_core import Metric

        by_family: dict[str, Any] = {}
        for (family, name, labels), value in samples.items():
            metric = by_family.get(family)
            if metric is None:
                kind, doc = self.families.get(family, ("untyped", ""))
                metric = by_family[family] = Metric(family, doc, kind)
            metric.add_sample(name, dict(labels), value)
        for metric in by_family.values():
            metric.samples.sort(key=_sample_order)
        metrics = [*by_family.values(), *extra]

        class _Collected:
            def collect(self) -> list[Any]:
                return metrics

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collected())
        return generate_latest(registry)


def _sample_order(sample: Any) -> tuple[Any, ...]:
    labels = sorted((k, v) for k, v in sample.labels.items() if k != "le")
    le = sample.labels.get("le")
    bound = float(le) if le is not None else 0.0
    return (labels, sample.name.endswith("_bucket") is False, bound, sample.name)


def per_worker(text: str) -> tuple[float, float]:
    """One worker's requests answered and requests in flight, from its exposition."""
    requests = in_flight = 0.0
    for line in text.splitlines():
        if line.startswith("llmgw_router_requests_total{"):
            requests += float(line.rsplit(" ", 1)[1])
        elif line.startswith("llmgw_router_in_flight{"):
            in_flight += float(line.rsplit(" ", 1)[1])
    return requests, in_flight
