"""The operator's imperative verbs, pure: what they hold and what they change.

``llmgw-control node cordon|uncordon|drain``, ``scale``, ``restart`` and ``rollout
pause|resume|undo`` (issue 29) each leave an *override* beside what the config says.
Overrides are kept in the state store (kind ``override``), so they survive a restart
and a failover, and every one records who made it and when. This module decides, with
no I/O and no clock of its own:

- :func:`apply` - one verb on the overrides, or a :class:`OpError` naming what is wrong;
- :func:`effective_catalog` - the catalog the reconciler works from: scale overrides
  change counts (autoscaled profiles take new bounds), an undone rollout runs the
  profile's previous revision again until the config changes it once more;
- :func:`directives` - what the reconciler must do this pass: nodes that take no new
  replicas (cordoned or draining), replicas to replace with surge (a node's drain, a
  restart: started elsewhere first, then drained, never fewer ready than wanted),
  replicas to retire at once (a drain's deadline passed), models whose rollout pauses;
- :func:`progress` - the words ``status`` shows about each override.

The reconciler applies a replacement as it applies a rollout
(:func:`llmgw_control.rollout.rollout_step` with at least one surge and none
unavailable), so a drain and a restart keep the guarantees a rollout has.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from llmgw_control.catalog import Catalog, ProfileSpec

__all__ = [
    "KIND",
    "Directives",
    "NodeOp",
    "OpError",
    "Ops",
    "RolloutOp",
    "ScaleOp",
    "Verb",
    "apply",
    "changes",
    "decode",
    "directives",
    "effective_catalog",
    "encode",
    "progress",
    "remember_previous",
    "settle",
]

# The store's record kind for every override.
KIND = "override"
# A node drain's deadline when none is given (seconds).
DEFAULT_DRAIN_DEADLINE = 600.0
MAX_REPLICAS = 10_000


class OpError(Exception):
    """A verb that cannot be applied; the message names what is wrong (HTTP ``status``)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class NodeOp(msgspec.Struct, frozen=True):
    cordoned: bool = False
    # Wall-clock time (epoch seconds) by which the node's replicas go regardless; 0 = no drain.
    drain_deadline: float = 0.0
    drain_started: float = 0.0
    by: str = ""
    at: float = 0.0


class ScaleOp(msgspec.Struct, frozen=True):
    model: str
    profile: str
    # A fixed count (autoscaled profiles: min = max = replicas), or new bounds.
    replicas: int | None = None
    min: int | None = None
    max: int | None = None
    by: str = ""
    at: float = 0.0


class RestartOp(msgspec.Struct, frozen=True):
    replica_id: str
    by: str = ""
    at: float = 0.0


class PinnedSpec(msgspec.Struct, frozen=True):
    """A profile's earlier revision, and the config revision it stands in for."""

    spec: dict[str, Any]
    instead_of: str


class RolloutOp(msgspec.Struct, frozen=True):
    model: str
    paused: bool = False
    # profile -> the earlier revision run instead of the config's (rollout undo).
    undone: dict[str, PinnedSpec] = {}
    by: str = ""
    at: float = 0.0


class PreviousOp(msgspec.Struct, frozen=True):
    """The revision a profile ran before the config last changed it (for undo)."""

    model: str
    profile: str
    spec: dict[str, Any]


@dataclass
class Ops:
    """Every override in force, by what it applies to."""

    nodes: dict[str, NodeOp] = field(default_factory=dict)
    scales: dict[tuple[str, str], ScaleOp] = field(default_factory=dict)
    restarts: dict[str, RestartOp] = field(default_factory=dict)
    rollouts: dict[str, RolloutOp] = field(default_factory=dict)
    previous: dict[tuple[str, str], PreviousOp] = field(default_factory=dict)


# --- the store's records ------------------------------------------------------------


def _key(*parts: str) -> str:
    # Model names may hold "/" and ":": a JSON list is unambiguous.
    return json.dumps(list(parts), separators=(",", ":"))


def encode(ops: Ops) -> dict[str, bytes]:
    """Every override as (key -> value) records of :data:`KIND`."""
    out: dict[str, bytes] = {}
    for node_id, n in ops.nodes.items():
        out[_key("node", node_id)] = msgspec.json.encode(n)
    for s in ops.scales.values():
        out[_key("scale", s.model, s.profile)] = msgspec.json.encode(s)
    for r in ops.restarts.values():
        out[_key("restart", r.replica_id)] = msgspec.json.encode(r)
    for ro in ops.rollouts.values():
        out[_key("rollout", ro.model)] = msgspec.json.encode(ro)
    for p in ops.previous.values():
        out[_key("previous", p.model, p.profile)] = msgspec.json.encode(p)
    return out


def decode(records: Mapping[str, bytes]) -> tuple[Ops, list[str]]:
    """The overrides back from the store, and a line for each record that was unreadable."""
    ops = Ops()
    problems: list[str] = []
    for key, value in records.items():
        try:
            parts = json.loads(key)
            what = parts[0]
            if what == "node":
                ops.nodes[parts[1]] = msgspec.json.decode(value, type=NodeOp)
            elif what == "scale":
                s = msgspec.json.decode(value, type=ScaleOp)
                ops.scales[(s.model, s.profile)] = s
            elif what == "restart":
                r = msgspec.json.decode(value, type=RestartOp)
                ops.restarts[r.replica_id] = r
            elif what == "rollout":
                ro = msgspec.json.decode(value, type=RolloutOp)
                ops.rollouts[ro.model] = ro
            elif what == "previous":
                p = msgspec.json.decode(value, type=PreviousOp)
                ops.previous[(p.model, p.profile)] = p
            else:
                problems.append(f"override {key[:80]!r}: unknown kind {what!r}")
        except (ValueError, IndexError, TypeError, msgspec.DecodeError) as err:
            problems.append(f"override {key[:80]!r}: {err}")
    return ops, problems


def changes(before: Ops, after: Ops) -> dict[str, bytes | None]:
    """The records to write (None: delete) to go from ``before`` to ``after``."""
    old, new = encode(before), encode(after)
    out: dict[str, bytes | None] = {k: v for k, v in new.items() if old.get(k) != v}
    out.update(dict.fromkeys(old.keys() - new.keys()))
    return out


# --- the verbs ----------------------------------------------------------------------


@dataclass(frozen=True)
class Verb:
    """One operator's request, as the admin API received it."""

    action: str  # cordon uncordon drain scale restart pause resume undo
    target: str = ""  # node id, model, model/profile or replica id
    replicas: int | None = None
    min: int | None = None
    max: int | None = None
    reset: bool = False
    deadline: float | None = None  # drain: seconds from now
    by: str = ""


def _profiles(catalog: Catalog, target: str) -> list[ProfileSpec]:
    """``MODEL`` (all its profiles) or ``MODEL/PROFILE``; model names may hold "/"."""
    if catalog.of_model(target):
        return catalog.of_model(target)
    model, sep, profile = target.rpartition("/")
    if sep:
        spec = catalog.get(model, profile)
        if spec is not None:
            return [spec]
    raise OpError(f"no model or model/profile {target!r} in the catalog", 404)


def apply(
    ops: Ops,
    verb: Verb,
    catalog: Catalog,
    *,
    nodes: Iterable[str],
    replicas: Mapping[str, tuple[str, str]],
    now: float,
) -> tuple[Ops, str]:
    """``verb`` applied to ``ops``: the new overrides and one line saying what changed.

    ``nodes``: ids the control plane knows; ``replicas``: replica id -> (model, profile).
    ``now`` is wall time.
    """
    new = dataclasses.replace(
        ops,
        nodes=dict(ops.nodes),
        scales=dict(ops.scales),
        restarts=dict(ops.restarts),
        rollouts=dict(ops.rollouts),
        previous=dict(ops.previous),
    )
    a, t, by = verb.action, verb.target, verb.by
    if not t:
        raise OpError(f"{a}: no target given")
    if a in ("cordon", "uncordon", "drain"):
        if t not in set(nodes) and t not in ops.nodes:
            raise OpError(f"no node {t!r} is known to the control plane", 404)
        current = new.nodes.get(t, NodeOp())
        if a == "cordon":
            new.nodes[t] = NodeOp(True, current.drain_deadline, current.drain_started, by, now)
            return new, f"node {t} cordoned: no new replicas are placed there"
        if a == "uncordon":
            new.nodes.pop(t, None)
            return new, f"node {t} uncordoned" + (
                " (its drain is cancelled)" if current.drain_deadline else ""
            )
        within = DEFAULT_DRAIN_DEADLINE if verb.deadline is None else verb.deadline
        if not 0 < within <= 7 * 24 * 3600:
            raise OpError(f"drain deadline {within:g}s is out of range (0 to 7 days)")
        new.nodes[t] = NodeOp(True, now + within, now, by, now)
        return new, f"node {t} draining: its replicas are replaced elsewhere within {within:g}s"
    if a == "scale":
        specs = _profiles(catalog, t)
        if len(specs) != 1:
            names = ", ".join(f"{t}/{p.name}" for p in specs)
            raise OpError(f"model {t!r} has several profiles: name one of {names}")
        spec = specs[0]
        if verb.reset:
            new.scales.pop(spec.key, None)
            return new, f"{spec.model}/{spec.name} back to the config's replicas"
        got = [x for x in (verb.replicas, verb.min, verb.max) if x is not None]
        if not got:
            raise OpError("scale: give a replica count N, or --min/--max, or --reset")
        if any(not 0 <= x <= MAX_REPLICAS for x in got):
            raise OpError(f"scale: counts must be from 0 to {MAX_REPLICAS}")
        if verb.replicas is not None and (verb.min is not None or verb.max is not None):
            raise OpError("scale: give either N or --min/--max, not both")
        if verb.replicas is None:
            lo = spec.min_replicas if verb.min is None else verb.min
            hi = spec.max_replicas if verb.max is None else verb.max
            if lo > hi or hi < 1:
                raise OpError(f"scale: --min {lo} --max {hi} is not a range (min <= max, max >= 1)")
            op = ScaleOp(spec.model, spec.name, None, lo, hi, by, now)
            new.scales[spec.key] = op
            return new, f"{spec.model}/{spec.name} autoscaled between {lo} and {hi}"
        new.scales[spec.key] = ScaleOp(spec.model, spec.name, verb.replicas, None, None, by, now)
        return new, f"{spec.model}/{spec.name} scaled to {verb.replicas}"
    if a == "restart":
        if t not in replicas:
            raise OpError(f"no replica {t!r}: `llmgw-control status` lists them", 404)
        new.restarts[t] = RestartOp(t, by, now)
        return new, f"replica {t} restarting: a new one starts first, then it is drained"
    if a in ("pause", "resume", "undo"):
        specs = _profiles(catalog, t)
        model = specs[0].model
        current_ro = new.rollouts.get(model, RolloutOp(model))
        if a == "pause":
            new.rollouts[model] = RolloutOp(model, True, current_ro.undone, by, now)
            return new, f"rollout of {model} paused: nothing more is started or drained for it"
        if a == "resume":
            if current_ro.undone:
                new.rollouts[model] = RolloutOp(model, False, current_ro.undone, by, now)
            else:
                new.rollouts.pop(model, None)
            return new, f"rollout of {model} resumed"
        undone: dict[str, PinnedSpec] = {}
        for spec in specs:
            prev = new.previous.get(spec.key)
            if prev is None or prev.spec.get("revision_of") == spec.revision:
                continue
            undone[spec.name] = PinnedSpec(prev.spec, spec.revision)
        if not undone:
            raise OpError(
                f"rollout undo {model}: no earlier revision of its profiles is known "
                "(one is kept each time a config reload changes a profile)",
                409,
            )
        new.rollouts[model] = RolloutOp(model, False, undone, by, now)
        names = ", ".join(sorted(undone))
        return new, f"rollout of {model} undone: {names} back to the previous revision"
    raise OpError(f"unknown operation {a!r}")


def spec_json(spec: ProfileSpec) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.to_builtins(
        {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    )
    out["revision_of"] = spec.revision
    return out


def spec_of(data: Mapping[str, Any]) -> ProfileSpec:
    fields = {f.name for f in dataclasses.fields(ProfileSpec)}
    kept = {k: v for k, v in data.items() if k in fields}
    spec = msgspec.convert(kept, type=ProfileSpec)
    return spec


def remember_previous(ops: Ops, old: Catalog, new: Catalog) -> Ops:
    """On a config reload: keep each changed profile's earlier revision (for undo), and
    drop undo pins the new config replaces (a new revision, or the profile gone)."""
    previous = dict(ops.previous)
    for spec in new.profiles:
        before = old.get(*spec.key)
        if before is not None and before.revision != spec.revision:
            # What ran before: an undone rollout's pinned spec, if one was in force.
            ro = ops.rollouts.get(spec.model)
            pinned = ro.undone.get(spec.name) if ro else None
            data = pinned.spec if pinned is not None else spec_json(before)
            previous[spec.key] = PreviousOp(spec.model, spec.name, data)
    rollouts = {}
    for model, ro in ops.rollouts.items():
        undone = {
            name: pin
            for name, pin in ro.undone.items()
            if (s := new.get(model, name)) is not None and s.revision == pin.instead_of
        }
        if ro.paused or undone:
            rollouts[model] = dataclasses.replace(ro, undone=undone)
    return dataclasses.replace(ops, previous=previous, rollouts=rollouts)


# --- what the reconciler does with them -----------------------------------------------


def effective_catalog(catalog: Catalog, ops: Ops) -> Catalog:
    """The catalog with scale overrides and undone rollouts applied."""
    if not ops.scales and not any(ro.undone for ro in ops.rollouts.values()):
        return catalog
    out = []
    for spec in catalog.profiles:
        ro = ops.rollouts.get(spec.model)
        pin = ro.undone.get(spec.name) if ro else None
        if pin is not None and pin.instead_of == spec.revision:
            try:
                old = spec_of(pin.spec)
            except (msgspec.ValidationError, TypeError):
                old = None
            if old is not None and old.key == spec.key:
                # The earlier launch, with today's counts and rollout settings.
                launch = {
                    f: getattr(old, f)
                    for f in (
                        "engine",
                        "model_ref",
                        "engine_args",
                        "env",
                        "gpus_per_node",
                        "cpu_threads",
                        "nodes",
                        "gpu_name",
                        "min_memory_bytes",
                        "same_label",
                        "served_model_names",
                    )
                }
                spec = dataclasses.replace(spec, **launch)
        s = ops.scales.get(spec.key)
        if s is not None:
            if s.replicas is not None:
                n = s.replicas
                spec = dataclasses.replace(spec, replicas=n, min_replicas=n, max_replicas=n)
            else:
                lo = spec.min_replicas if s.min is None else s.min
                hi = spec.max_replicas if s.max is None else s.max
                spec = dataclasses.replace(spec, replicas=lo, min_replicas=lo, max_replicas=hi)
        out.append(spec)
    # Adapters and all as the config says; fresh lookup tables for the new profiles.
    return dataclasses.replace(catalog, profiles=tuple(out), _by_key={}, _by_adapter={})


@dataclass(frozen=True)
class Directives:
    """What the overrides ask of one reconcile pass."""

    # Nodes that take no new replica (cordoned, or draining).
    cordoned: frozenset[str] = frozenset()
    # Replicas replaced with surge: a new one first, then this one drained.
    replace: Mapping[str, str] = field(default_factory=dict)  # replica id -> why
    # Replicas drained now whatever stands in for them (a drain's deadline passed).
    evict: Mapping[str, str] = field(default_factory=dict)
    # Models whose rollout (and replacements) start and drain nothing.
    paused: frozenset[str] = frozenset()


def directives(ops: Ops, on_nodes: Mapping[str, Iterable[str]], now: float) -> Directives:
    """``on_nodes``: replica id -> the nodes its shards run on. ``now`` is wall time."""
    cordoned = frozenset(n for n, op in ops.nodes.items() if op.cordoned or op.drain_deadline)
    replace: dict[str, str] = {}
    evict: dict[str, str] = {}
    for rid, nodes in on_nodes.items():
        for node_id in nodes:
            op = ops.nodes.get(node_id)
            if op is None or not op.drain_deadline:
                continue
            if now >= op.drain_deadline:
                evict[rid] = f"draining: node {node_id} drain deadline passed"
            else:
                replace[rid] = f"draining: node {node_id} is drained"
            break
    for rid, r in ops.restarts.items():
        if rid in on_nodes and rid not in replace and rid not in evict:
            replace[rid] = f"draining: restarted by {r.by or 'an operator'}"
    paused = frozenset(m for m, ro in ops.rollouts.items() if ro.paused)
    return Directives(cordoned, replace, evict, paused)


def settle(ops: Ops, live: Iterable[str]) -> Ops:
    """Restarts of replicas that are gone are done: forget them."""
    alive = set(live)
    done = [rid for rid in ops.restarts if rid not in alive]
    if not done:
        return ops
    return dataclasses.replace(
        ops, restarts={k: v for k, v in ops.restarts.items() if k not in done}
    )


def explain_overrides(out: dict[str, Any], ops: Ops, config: Catalog) -> None:
    """Add to ``explain``'s JSON (``{model, profiles: [{profile, ...}]}``) what the
    overrides change of each profile, with what the config says."""
    model = str(out.get("model", ""))
    ro = ops.rollouts.get(model)
    for p in out.get("profiles", []):
        name = str(p.get("profile", ""))
        spec = config.get(model, name)
        notes = []
        s = ops.scales.get((model, name))
        if s is not None and spec is not None:
            said = (
                f"{spec.replicas}"
                if spec.min_replicas == spec.max_replicas
                else f"{spec.min_replicas}-{spec.max_replicas}"
            )
            now = f"{s.replicas}" if s.replicas is not None else f"{s.min}-{s.max}"
            notes.append(f"scaled to {now} by {s.by or '?'} (the config says {said})")
        if ro is not None and ro.paused:
            notes.append(f"rollout paused by {ro.by or '?'}")
        if ro is not None and name in ro.undone:
            notes.append(f"rollout undone by {ro.by or '?'}: the previous revision runs")
        if notes:
            p["overrides"] = notes


def progress(
    ops: Ops, on_nodes: Mapping[str, Iterable[str]], now: float
) -> dict[str, list[dict[str, Any]]]:
    """The overrides as status shows them (``now`` wall time)."""
    left: dict[str, int] = {}
    for nodes in on_nodes.values():
        for node_id in set(nodes):
            left[node_id] = left.get(node_id, 0) + 1
    nodes_out = []
    for node_id, n in sorted(ops.nodes.items()):
        row: dict[str, Any] = {"node_id": node_id, "cordoned": True, "by": n.by, "at": n.at}
        if n.drain_deadline:
            remaining = left.get(node_id, 0)
            if remaining == 0:
                state = "drained"
            elif now >= n.drain_deadline:
                state = "deadline passed"
            else:
                state = "draining"
            row["drain"] = {
                "state": state,
                "replicas_left": remaining,
                "deadline_in": max(0.0, round(n.drain_deadline - now, 1)),
            }
        nodes_out.append(row)
    return {
        "nodes": nodes_out,
        "scales": [
            {
                "model": s.model,
                "profile": s.profile,
                "replicas": s.replicas,
                "min": s.min,
                "max": s.max,
                "by": s.by,
                "at": s.at,
            }
            for _, s in sorted(ops.scales.items())
        ],
        "restarts": [
            {"replica_id": r.replica_id, "by": r.by, "at": r.at}
            for _, r in sorted(ops.restarts.items())
        ],
        "rollouts": [
            {
                "model": ro.model,
                "paused": ro.paused,
                "undone": sorted(ro.undone),
                "by": ro.by,
                "at": ro.at,
            }
            for _, ro in sorted(ops.rollouts.items())
        ],
    }
