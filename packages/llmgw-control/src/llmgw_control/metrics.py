"""Prometheus metrics of one control plane, in its own registry (tests run several)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["Metrics"]

# (model, profile, state) -> replicas; state -> nodes.
ReplicaCounts = Callable[[], Mapping[tuple[str, str, str], int]]
NodeCounts = Callable[[], Mapping[str, int]]


class _FleetCollector(Collector):
    """Node and replica counts, computed when scraped rather than on every pass."""

    def __init__(self, nodes: NodeCounts, replicas: ReplicaCounts) -> None:
        self.nodes = nodes
        self.replicas = replicas

    def collect(self) -> Iterator[GaugeMetricFamily]:
        nodes = GaugeMetricFamily("llmgw_control_nodes", "Nodes by state.", labels=["state"])
        for state, count in sorted(self.nodes().items()):
            nodes.add_metric([state], count)
        yield nodes
        replicas = GaugeMetricFamily(
            "llmgw_control_replicas", "Replicas by state.", labels=["model", "profile", "state"]
        )
        for key, count in sorted(self.replicas().items()):
            replicas.add_metric(list(key), count)
        yield replicas


# (model, profile) -> {"wanted": ...} per autoscaled profile; (model, profile) -> rollout.
Scaling = Callable[[], Mapping[tuple[str, str], Mapping[str, Any]]]


class _LifecycleCollector(Collector):
    """What the autoscaler wants and which rollouts run, computed when scraped."""

    def __init__(self, scaling: Scaling, rollouts: Scaling) -> None:
        self.scaling = scaling
        self.rollouts = rollouts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        wanted = GaugeMetricFamily(
            "llmgw_control_wanted_replicas",
            "Replicas the autoscaler wants, per autoscaled profile.",
            labels=["model", "profile"],
        )
        for (model, profile), s in sorted(self.scaling().items()):
            wanted.add_metric([model, profile], float(s["wanted"]))
        yield wanted
        rollouts = GaugeMetricFamily(
            "llmgw_control_rollout_old_replicas",
            "Replicas of an older revision left to replace, by rollout state.",
            labels=["model", "profile", "state"],
        )
        for (model, profile), r in sorted(self.rollouts().items()):
            rollouts.add_metric([model, profile, str(r["state"])], float(r["old"]))
        yield rollouts


# Heartbeat lag is dominated by event-loop delay: resolve the low milliseconds finely.
_LAG_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
    0.075, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
)  # fmt: skip


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.nodes = Gauge("llmgw_control_nodes", "Nodes by state.", ["state"], registry=r)
        self.replicas = Gauge(
            "llmgw_control_replicas",
            "Replicas by state.",
            ["model", "profile", "state"],
            registry=r,
        )
        self.streams = Gauge("llmgw_control_agent_streams", "Open agent streams.", registry=r)
        self.watchers = Gauge("llmgw_control_watchers", "Open endpoint watch streams.", registry=r)
        self.heartbeats = Counter("llmgw_control_heartbeats", "Heartbeats handled.", registry=r)
        self.heartbeat_lag = Histogram(
            "llmgw_control_heartbeat_lag_seconds",
            "From a heartbeat's sent_at to the moment control handled it.",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.loop_lag = Histogram(
            "llmgw_control_loop_lag_seconds",
            "How late the event loop ran a timer: every message waits at least this long.",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.registrations = Counter(
            "llmgw_control_registrations", "Register messages accepted.", registry=r
        )
        self.refusals = Counter(
            "llmgw_control_refusals",
            "Connections and streams refused: TLS handshakes, node ids that differ from the "
            "certificate, watches without a router certificate.",
            ["stream", "reason"],
            registry=r,
        )
        self.commands = Counter(
            "llmgw_control_commands",
            "Commands sent to agents, by kind and result.",
            ["kind", "result"],
            registry=r,
        )
        self.reconciles = Counter("llmgw_control_reconciles", "Reconcile passes.", registry=r)
        self.reconcile_seconds = Histogram(
            "llmgw_control_reconcile_seconds", "Time of one reconcile pass.", registry=r
        )
        self.publish_version = Gauge(
            "llmgw_control_publish_version", "Version of the endpoint snapshot.", registry=r
        )
        self.published = Gauge(
            "llmgw_control_published_endpoints", "Endpoints in the snapshot.", registry=r
        )

    def count_fleet(self, nodes: NodeCounts, replicas: ReplicaCounts) -> None:
        self.registry.register(_FleetCollector(nodes, replicas))

    def count_lifecycle(self, scaling: Scaling, rollouts: Scaling) -> None:
        self.registry.register(_LifecycleCollector(scaling, rollouts))
