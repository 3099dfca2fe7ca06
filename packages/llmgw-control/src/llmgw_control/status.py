"""What the control plane shows about itself: the status, summary and explain JSON.

Pure: built from one :class:`Fleet` (the records the control plane holds at one
moment), no I/O. The admin HTTP responder (:mod:`llmgw_control.admin`) serves it;
``llmgw-control status`` and ``explain`` and the web status page read it.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmgw_proto import v1

from llmgw_control.attention import needs_attention
from llmgw_control.catalog import Catalog
from llmgw_control.inventory import Node, NodeState
from llmgw_control.publish import EndpointInfo
from llmgw_control.records import ControlState, Replica, replica_state

__all__ = ["Fleet", "explain", "status", "summary", "unplaced_reason"]


@dataclass(frozen=True)
class Fleet:
    """Everything status shows, as the control plane holds it at one moment."""

    catalog: Catalog
    nodes: Mapping[str, Node]
    state: ControlState
    now: float
    mgmt_interface: str = ""
    started: dt.datetime | None = None
    ticks: int = 0
    publish_version: int = 0
    streams: int = 0
    # replica id -> the endpoint as published (the agent's URL).
    published: Mapping[str, EndpointInfo] = field(default_factory=dict)
    # replica id -> why routers may not reach its published address.
    address_problems: Mapping[str, str] = field(default_factory=dict)
    # endpoint id -> its latest load figures, as routers get them.
    loads: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # (model, profile) -> rollout and autoscaling state, as JSON.
    rollouts: Mapping[tuple[str, str], Mapping[str, Any]] = field(default_factory=dict)
    scaling: Mapping[tuple[str, str], Mapping[str, Any]] = field(default_factory=dict)
    # The last refused config reload, {at, error}, until one succeeds.
    reload_refused: Mapping[str, str] | None = None
    # Per model now, and the last hour of it (llmgw_control.history): the page's rows.
    models: list[dict[str, Any]] = field(default_factory=list)
    history: Mapping[str, Any] | None = None


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def status(f: Fleet) -> dict[str, Any]:
    nodes = [_node(f, n) for n in sorted(f.nodes.values(), key=lambda n: n.node_id)]
    replicas = [
        _replica(f, r)
        for r in sorted(f.state.replicas.values(), key=lambda r: (r.model, r.profile, r.replica_id))
    ]
    out = {
        "started": _iso(f.started),
        # Every wake-up of the loop; a tick with no new input and no deadline due
        # decides "nothing to do" without running the pass; full_passes are those run.
        "reconciles": f.ticks,
        "full_passes": f.state.passes,
        "publish_version": f.publish_version,
        "nodes": nodes,
        "replicas": replicas,
        "unplaceable": [
            {k: x[k] for k in ("replica_id", "model", "profile", "reason", "explanation")}
            for x in replicas
            if x["state"] == "unplaced"
        ],
        "warnings": [
            {"replica_id": rid, "warning": text} for rid, text in sorted(f.address_problems.items())
        ],
        "rollouts": [{"model": m, "profile": p, **r} for (m, p), r in sorted(f.rollouts.items())],
        "scaling": [{"model": m, "profile": p, **r} for (m, p), r in sorted(f.scaling.items())],
        "config_reload_refused": dict(f.reload_refused) if f.reload_refused else None,
        "models": f.models,
        "history": dict(f.history) if f.history is not None else None,
    }
    # What a person should look at (llmgw_control.attention): status's last lines and
    # exit status, the page's banner.
    out["attention"] = needs_attention(out)
    return out


def summary(f: Fleet) -> dict[str, Any]:
    """Counts only: cheap enough to poll during a reconnect storm."""
    nodes: dict[str, int] = {}
    for n in f.nodes.values():
        nodes[n.state.value] = nodes.get(n.state.value, 0) + 1
    replicas: dict[str, int] = {}
    for r in f.state.replicas.values():
        state = replica_state(r, f.nodes, f.now)
        replicas[state] = replicas.get(state, 0) + 1
    return {
        "reconciles": f.ticks,
        "full_passes": f.state.passes,
        "publish_version": f.publish_version,
        "streams": f.streams,
        "nodes": nodes,
        "replicas": replicas,
        "adopted": sum(1 for r in f.state.replicas.values() if r.adopted),
    }


def explain(f: Fleet, model: str) -> dict[str, Any] | None:
    profiles = f.catalog.of_model(model)
    known = {r.profile for r in f.state.replicas.values() if r.model == model}
    if not profiles and not known:
        return None
    out = []
    for name in [p.name for p in profiles] + sorted(known - {p.name for p in profiles}):
        spec = f.catalog.get(model, name)
        entry: dict[str, Any] = {
            "profile": name,
            "wanted": spec.replicas if spec is not None else 0,
            "replicas": [
                _replica(f, r)
                for r in sorted(f.state.replicas.values(), key=lambda r: r.replica_id)
                if r.model == model and r.profile == name
            ],
        }
        if (model, name) in f.rollouts:
            entry["rollout"] = dict(f.rollouts[(model, name)])
        if (model, name) in f.scaling:
            entry["scaling"] = dict(f.scaling[(model, name)])
            entry["wanted"] = entry["scaling"]["wanted"]
        live = [r for r in entry["replicas"] if r["state"] != "draining"]
        has = sum(1 for r in live if r["nodes"])
        unplaced = next((r["explanation"] for r in live if r["state"] == "unplaced"), "")
        if has < entry["wanted"] and unplaced:
            entry["summary"] = f"wants {entry['wanted']}, has {has}: {unplaced}"
        out.append(entry)
    return {"model": model, "profiles": out}


def unplaced_reason(explanation: str) -> str:
    """A few words for a table cell: the explanation's first (largest) reason.

    ``0 of 3 nodes fit: 2 have too few free GPUs (need 4, ...), 1 is lost`` becomes
    ``too few free GPUs``; ``explain`` gives the rest.
    """
    head, sep, rest = explanation.partition(": ")
    if ", need " in head:  # a multi-node shortfall: "2 of 3 nodes fit, need 2 sharing ..."
        return head.split(", ", 1)[1].split(" (")[0]
    if not sep:
        return explanation
    first = rest.split(" (")[0].split(", ")[0]
    first = _LACK.sub("no ", first)
    return _COUNT_VERB.sub("", first)


_COUNT_VERB = re.compile(r"^\d+ (?:has|have|is|are) ")
_LACK = re.compile(r"^\d+ (?:lacks|lack) ")


def _node(f: Fleet, n: Node) -> dict[str, Any]:
    used = {
        i
        for r in f.state.replicas.values()
        for p in r.shards
        if p.node_id == n.node_id
        for i in p.gpu_indices
    }
    return {
        "node_id": n.node_id,
        "state": n.state.value,
        "connected": n.connected,
        "address": n.address(f.mgmt_interface),
        "peer": n.peer_host,
        "agent_version": n.agent_version,
        "engines": [
            {"kind": e.kind, "version": e.version, "executable": e.executable, "error": e.error}
            for e in n.engines
        ],
        "simulated": n.simulated,
        "labels": n.labels,
        "last_heartbeat": _iso(n.last_heartbeat_at),
        "registered": _iso(n.registered_at),
        "gpus": [
            {
                "index": g.index,
                "name": g.name,
                "memory_bytes": g.memory_bytes,
                "in_use": g.index in used,
                "memory_used_bytes": n.gpu_usage.get(g.index, (0, 0))[0],
                "utilization_percent": n.gpu_usage.get(g.index, (0, 0))[1],
            }
            for g in n.gpus
        ],
        "gpus_used": sum(1 for g in n.gpus if g.index in used),
        "gpus_total": len(n.gpus),
        "shards": len([s for s in n.shards.values() if s.running]),
    }


def _replica(f: Fleet, r: Replica) -> dict[str, Any]:
    shards = []
    leader_url = ""
    for p in r.shards:
        node = f.nodes.get(p.node_id)
        report = node.shards.get(p.shard_id) if node is not None else None
        # A node that does not answer: its last report is no news of the shard.
        heard = node is not None and node.state == NodeState.READY
        if p.rank == 0 and report is not None:
            leader_url = report.endpoint_url
        shards.append(
            {
                "shard_id": p.shard_id,
                "node_id": p.node_id,
                "rank": p.rank,
                "gpu_indices": list(p.gpu_indices),
                "port": p.port,
                "state": (
                    v1.ShardState(report.state).name.lower()
                    if report and heard
                    else "unknown"
                    if report is None
                    else "unreachable"
                ),
                "pid": report.pid if report else 0,
                "endpoint_url": report.endpoint_url if report else "",
            }
        )
    published = f.published.get(r.replica_id)
    state = replica_state(r, f.nodes, f.now)
    return {
        "replica_id": r.replica_id,
        "model": r.model,
        "profile": r.profile,
        "state": state,
        # Adopted: found running at a restart. An unplaced replica runs nowhere.
        "adopted": r.adopted and r.placed,
        "nodes": [p.node_id for p in r.shards],
        # The agent's URL: exactly what routers are given.
        "endpoint": published.url if published else (leader_url or None),
        "published": published is not None,
        "endpoint_warning": f.address_problems.get(r.replica_id),
        "load": dict(f.loads[r.replica_id]) if r.replica_id in f.loads else None,
        "shards": shards,
        "failures": r.failures,
        "retry_in": round(max(r.retry_at - f.now, 0.0), 3),
        "last_error": r.last_error,
        "output_tail": r.last_output_tail,
        "reason": unplaced_reason(r.explanation) if state == "unplaced" else "",
        "explanation": r.explanation,
    }
