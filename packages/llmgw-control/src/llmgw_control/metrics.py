"""Prometheus metrics of one control plane, in its own registry (tests run several)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
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


# (model, profile) -> the most consecutive failures of any of its replicas.
Failures = Callable[[], Mapping[tuple[str, str], int]]


class _FailureCollector(Collector):
    """Engine restarts: consecutive failures per profile, every profile present (0)."""

    def __init__(self, failures: Failures) -> None:
        self.failures = failures

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "llmgw_control_replica_failures",
            "Consecutive engine failures of a profile's replicas (the most of any one; "
            "0 again once it is ready): each failure restarts the engine with backoff.",
            labels=["model", "profile"],
        )
        for (model, profile), count in sorted(self.failures().items()):
            family.add_metric([model, profile], float(count))
        yield family


def failures_by_profile(
    profiles: Iterable[tuple[str, str]], replicas: Iterable[Any]
) -> dict[tuple[str, str], int]:
    """The most consecutive failures of any replica per profile; 0 for every profile."""
    out = dict.fromkeys(profiles, 0)
    for r in replicas:
        key = (r.model, r.profile)
        out[key] = max(out.get(key, 0), r.failures)
    return out


# Refusals with a fixed reason, counted from 0 before the first one (a dashboard panel
# or an alert on them reads 0, not "No data"); TLS refusals carry the handshake's words.
KNOWN_REFUSALS = (
    ("agent", "identity"),
    ("agent", "shard status too large"),
    ("agent", "shard not asked for"),
    ("watch", "identity"),
    ("watch", "not a router"),
)


# Heartbeat lag is dominated by event-loop delay: resolve the low milliseconds finely.
_LAG_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
    0.075, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
)  # fmt: skip


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # llmgw_control_nodes and llmgw_control_replicas come from _FleetCollector alone
        # (count_fleet): a Gauge of the same name as well wrote HELP/TYPE twice.
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
        for stream, reason in KNOWN_REFUSALS:
            self.refusals.labels(stream, reason)
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

    def count_failures(self, failures: Failures) -> None:
        self.registry.register(_FailureCollector(failures))

    def count_lifecycle(self, scaling: Scaling, rollouts: Scaling) -> None:
        self.registry.register(_LifecycleCollector(scaling, rollouts))
