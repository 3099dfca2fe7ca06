"""The operator's verbs, pure (llmgw_control.ops): overrides, and what passes do with them."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_control import ops
from llmgw_control.auth import Credentials, Denied, authorize
from llmgw_control.catalog import Catalog, ModelConfig, build_catalog
from llmgw_control.inventory import Node, NodeState, ShardReport
from llmgw_control.opscli import render_operations, rollout_verdict
from llmgw_control.placement import Demand, GpuSlot, NodeView, Placement, Placer
from llmgw_control.reconciler import Decision, Settings, reconcile
from llmgw_control.records import ControlState, Drain, Start
from llmgw_control.rollout import ReplicaView, rollout_step
from llmgw_control.scaling import ScaleSpec, ScaleState, autoscale
from llmgw_proto import v1

S = v1.ShardState
GiB = 2**30
SETTINGS = Settings(
    port_range=(20000, 20099),
    mgmt_interface="lo",
    drain_timeout=10.0,
    stop_grace=5.0,
    startup_grace=0.0,
)


def catalog(**profile: Any) -> Catalog:
    fields = {"engine": "vllm", "gpus_per_node": 1, "replicas": 2, **profile}
    models = msgspec.convert([{"name": "m", "profiles": {"p": fields}}], list[ModelConfig])
    return build_catalog(models, "control.yaml")


def make_node(node_id: str, gpus: int = 2, address: str = "127.0.0.1") -> Node:
    return Node(
        node_id,
        "s1",
        gpus=tuple(GpuSlot(i, "NVIDIA H100", 80 * GiB) for i in range(gpus)),
        interfaces={"lo": [address]},
    )


class World:
    def __init__(self, cat: Catalog, *nodes: Node) -> None:
        self.catalog = cat
        self.nodes = {n.node_id: n for n in nodes}
        self.state = ControlState()
        self.now = 100.0
        self.ids = (f"m.p.{i:04x}" for i in itertools.count())
        self.ops = ops.Ops()

    def step(self) -> Decision:
        self.now += 1.0
        on_nodes = {
            rid: [p.node_id for p in r.shards]
            for rid, r in self.state.replicas.items()
            if not r.draining
        }
        d = reconcile(
            ops.effective_catalog(self.catalog, self.ops),
            self.nodes,
            self.state,
            self.now,
            SETTINGS,
            lambda m, p: next(self.ids),
            ops=ops.directives(self.ops, on_nodes, self.now),
        )
        self.state = d.state
        self.ops = ops.settle(self.ops, self.state.replicas)
        return d

    def report(self, start: Start, state: v1.ShardState) -> None:
        self.nodes[start.node_id].shards[start.shard_id] = ShardReport(
            start.shard_id,
            start.replica_id,
            state,
            model=start.profile.model,
            profile=start.profile.name,
            gpu_indices=start.gpu_indices,
            port=start.port,
            rank=start.rank,
            world_size=start.size,
            endpoint_url=f"http://127.0.0.1:{start.port}",
        )

    def ready(self) -> int:
        return sum(1 for r in self.state.replicas.values() if r.ready_since is not None)

    def apply(self, verb: ops.Verb) -> str:
        self.ops, line = ops.apply(
            self.ops,
            verb,
            self.catalog,
            nodes=self.nodes,
            replicas={rid: r.key for rid, r in self.state.replicas.items()},
            now=self.now,
        )
        return line


def starts(d: Decision) -> list[Start]:
    return [c for c in d.commands if isinstance(c, Start)]


def run_ready(world: World, d: Decision) -> None:
    for s in starts(d):
        world.report(s, S.READY)


def test_drain_replaces_with_surge_then_drains() -> None:
    world = World(catalog(replicas=2), make_node("a"), make_node("b"), make_node("c"))
    first = starts(world.step())
    for s in first:
        world.report(s, S.READY)
    world.step()
    assert world.ready() == 2
    drained_node = first[0].node_id
    world.apply(ops.Verb("drain", drained_node, deadline=600.0, by="token"))
    d = world.step()
    # New replicas first, elsewhere; nothing there is drained while they are not ready.
    assert starts(d)
    assert drained_node not in {s.node_id for s in starts(d)}
    assert not [c for c in d.commands if isinstance(c, Drain)]
    assert world.ready() == 2
    run_ready(world, d)
    d = world.step()
    drained = [c for c in d.commands if isinstance(c, Drain)]
    assert drained
    assert {c.node_id for c in drained} == {drained_node}
    assert world.ready() >= 2
    progress = ops.progress(world.ops, {"x": [drained_node]}, world.now)
    assert progress["nodes"][0]["drain"]["state"] == "draining"
    assert ops.progress(world.ops, {}, world.now)["nodes"][0]["drain"]["state"] == "drained"


def test_drain_deadline_evicts_what_cannot_be_replaced() -> None:
    world = World(catalog(replicas=1), make_node("a"))
    run_ready(world, world.step())
    world.step()
    world.apply(ops.Verb("drain", "a", deadline=5.0))
    d = world.step()
    assert not starts(d)
    assert not [c for c in d.commands if isinstance(c, Drain)]
    world.now += 10.0
    d = world.step()
    assert [c.node_id for c in d.commands if isinstance(c, Drain)] == ["a"]


def test_restart_surges_and_forgets_itself_when_done() -> None:
    world = World(catalog(replicas=1), make_node("a"), make_node("b"))
    run_ready(world, world.step())
    world.step()
    (rid,) = world.state.replicas
    world.apply(ops.Verb("restart", rid, by="admin:alice"))
    d = world.step()
    assert len(starts(d)) == 1
    assert world.ready() == 1
    run_ready(world, d)
    d = world.step()
    assert [c.shard_id.startswith(rid) for c in d.commands if isinstance(c, Drain)] == [True]
    world.state.replicas.pop(rid)  # its drain ended
    for node in world.nodes.values():
        node.shards = {k: v for k, v in node.shards.items() if v.replica_id != rid}
    world.step()
    assert world.ops.restarts == {}


def test_pause_freezes_a_rollout_and_resume_lets_it_go() -> None:
    world = World(catalog(replicas=1), make_node("a"), make_node("b"))
    run_ready(world, world.step())
    world.step()
    world.catalog = catalog(replicas=1, engine_args=["--x"])
    world.apply(ops.Verb("pause", "m"))
    d = world.step()
    assert not starts(d)
    assert d.rollouts[("m", "p")]["state"] == "paused"
    world.apply(ops.Verb("resume", "m"))
    assert starts(world.step())


def test_scale_overrides_the_count_without_a_rollout() -> None:
    cat = catalog(replicas=2)
    o, line = ops.apply(ops.Ops(), ops.Verb("scale", "m/p", replicas=5), cat, nodes=[],
                        replicas={}, now=0.0)  # fmt: skip
    assert line == "m/p scaled to 5"
    eff = ops.effective_catalog(cat, o)
    spec = eff.get("m", "p")
    assert spec is not None
    assert spec.replicas == 5
    assert spec.revision == cat.profiles[0].revision  # a count is no rollout
    o, _ = ops.apply(o, ops.Verb("scale", "m", reset=True), cat, nodes=[], replicas={}, now=0.0)
    assert ops.effective_catalog(cat, o).get("m", "p") == cat.get("m", "p")
    auto = catalog(replicas={"min": 1, "max": 3})
    o, line = ops.apply(ops.Ops(), ops.Verb("scale", "m", max=8), auto, nodes=[], replicas={},
                        now=0.0)  # fmt: skip
    spec = ops.effective_catalog(auto, o).get("m", "p")
    assert spec is not None
    assert (spec.min_replicas, spec.max_replicas) == (1, 8)


@pytest.mark.parametrize(
    ("verb", "status", "words"),
    [
        (ops.Verb("cordon", "nope"), 404, "no node 'nope'"),
        (ops.Verb("scale", "x", replicas=1), 404, "no model or model/profile 'x'"),
        (ops.Verb("scale", "m"), 400, "give a replica count"),
        (ops.Verb("scale", "m", min=3, max=2), 400, "not a range"),
        (ops.Verb("scale", "m", replicas=1, max=2), 400, "not both"),
        (ops.Verb("scale", "m", replicas=10**6), 400, "from 0 to"),
        (ops.Verb("restart", "r"), 404, "no replica 'r'"),
        (ops.Verb("undo", "m"), 409, "no earlier revision"),
        (ops.Verb("drain", "a", deadline=-1), 400, "out of range"),
        (ops.Verb("explode", "a"), 400, "unknown operation"),
    ],
)
def test_refusals_name_what_is_wrong(verb: ops.Verb, status: int, words: str) -> None:
    with pytest.raises(ops.OpError, match=words) as err:
        ops.apply(ops.Ops(), verb, catalog(), nodes=["a"], replicas={}, now=0.0)
    assert err.value.status == status


def test_undo_runs_the_previous_revision_until_the_config_changes_again() -> None:
    old, new = catalog(), catalog(engine_args=["--new"])
    o = ops.remember_previous(ops.Ops(), old, new)
    o, _ = ops.apply(o, ops.Verb("undo", "m"), new, nodes=[], replicas={}, now=0.0)
    eff = ops.effective_catalog(new, o).get("m", "p")
    assert eff is not None
    assert eff.revision == old.profiles[0].revision
    # Stored and read back, it still applies.
    back, problems = ops.decode(ops.encode(o))
    assert problems == []
    assert ops.effective_catalog(new, back).get("m", "p") == eff
    newer = catalog(engine_args=["--newer"])
    o = ops.remember_previous(o, new, newer)
    assert ops.effective_catalog(newer, o).get("m", "p") == newer.get("m", "p")
    # What ran last (the undone revision) is what a further undo goes back to.
    assert o.previous[("m", "p")].spec["revision_of"] == old.profiles[0].revision


# --- properties ---------------------------------------------------------------------

verbs = st.one_of(
    st.builds(
        ops.Verb,
        st.sampled_from(["cordon", "uncordon"]),
        st.sampled_from(["a", "b"]),
        by=st.text(max_size=5),
    ),
    st.builds(ops.Verb, st.just("drain"), st.sampled_from(["a", "b"]), deadline=st.floats(1, 1000)),
    st.builds(ops.Verb, st.just("scale"), st.just("m"), replicas=st.integers(0, 50)),
    st.builds(ops.Verb, st.just("scale"), st.just("m"), reset=st.just(True)),
    st.builds(ops.Verb, st.sampled_from(["pause", "resume"]), st.just("m")),
    st.builds(ops.Verb, st.just("restart"), st.sampled_from(["r1", "r2"])),
)


@given(st.lists(verbs, max_size=12))
def test_overrides_survive_the_store(sequence: list[ops.Verb]) -> None:
    o = ops.Ops()
    cat = catalog()
    for v in sequence:
        before = o
        o, _ = ops.apply(o, v, cat, nodes=["a", "b"], replicas={"r1": ("m", "p"),
                         "r2": ("m", "p")}, now=1.0)  # fmt: skip
        # Only what changed is written; applying the writes to the old records gives the new.
        records = ops.encode(before)
        for key, value in ops.changes(before, o).items():
            if value is None:
                records.pop(key)
            else:
                records[key] = value
        assert records == ops.encode(o)
    back, problems = ops.decode(ops.encode(o))
    assert problems == []
    assert back == o


@st.composite
def fleets(draw: st.DrawFn) -> tuple[list[NodeView], set[str], int]:
    n = draw(st.integers(1, 6))
    views = [
        NodeView(
            f"n{i}",
            NodeState.READY,
            tuple(GpuSlot(g, "NVIDIA H100", 80 * GiB) for g in range(draw(st.integers(0, 4)))),
            address=f"10.0.0.{i}",
            used_gpus=set(draw(st.sets(st.integers(0, 3), max_size=2))),
        )
        for i in range(n)
    ]
    cordoned = draw(st.sets(st.sampled_from([v.node_id for v in views])))
    for v in views:
        v.cordoned = v.node_id in cordoned
    return views, cordoned, draw(st.integers(0, 2))


@given(fleets(), st.integers(1, 8))
def test_cordoned_nodes_get_no_new_placement(fleet: Any, count: int) -> None:
    views, cordoned, gpus = fleet
    placer = Placer(views, (20000, 20099))
    cat = catalog(gpus_per_node=gpus)
    demand = Demand.of(cat.profiles[0])
    for _ in range(count):
        result = placer.place(demand)
        if isinstance(result, Placement):
            assert not {s.node_id for s in result.shards} & cordoned
        else:
            assert "cordoned" not in result.explanation or cordoned


views = st.builds(
    ReplicaView,
    st.uuids().map(str),
    ready=st.booleans(),
    placed=st.booleans(),
    ready_since=st.floats(0, 100),
)


@given(st.integers(0, 6), st.lists(views, max_size=6), st.lists(views, max_size=6),
       st.integers(1, 3))  # fmt: skip
def test_a_replacement_never_leaves_fewer_ready_than_wanted(
    wanted: int, new: list[ReplicaView], old: list[ReplicaView], surge: int
) -> None:
    # A drain or restart is a rollout step with surge and no unavailability (reconciler).
    step = rollout_step(wanted, new, old, surge, 0)
    ready_before = sum(r.ready for r in [*new, *old])
    drained = set(step.drain)
    ready_after = sum(r.ready for r in [*new, *old] if r.replica_id not in drained)
    assert ready_after >= min(wanted, ready_before)


@given(
    st.dictionaries(st.sampled_from(["r1", "r2", "r3"]),
                    st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=2)),
    st.dictionaries(st.sampled_from(["a", "b", "c"]), st.floats(0, 200)),
    st.floats(0, 200),
)  # fmt: skip
@settings(max_examples=200)
def test_a_drained_node_keeps_nothing_past_its_deadline(
    on_nodes: dict[str, list[str]], deadlines: dict[str, float], now: float
) -> None:
    o = ops.Ops(nodes={n: ops.NodeOp(True, d + 1.0, 0.0) for n, d in deadlines.items()})
    d = ops.directives(o, on_nodes, now)
    assert d.cordoned == frozenset(deadlines)
    for rid, nodes in on_nodes.items():
        draining = [n for n in nodes if n in deadlines]
        if not draining:
            assert rid not in d.replace
            assert rid not in d.evict
        elif any(now >= deadlines[n] + 1.0 for n in draining[:1]):
            assert rid in d.evict
        else:
            assert rid in d.replace


# --- authentication and the CLI's reading --------------------------------------------


def test_authorize() -> None:
    creds = Credentials(token="t" * 20, certificates=True)
    assert authorize(creds, "Bearer " + "t" * 20, None) == "token"
    assert isinstance(authorize(creds, "", None), Denied)
    assert authorize(creds, "Bearer wrong", None) == Denied(401, "wrong admin token")
    admin: dict[str, object] = {
        "subject": ((("organizationalUnitName", "admin"),), (("commonName", "alice"),))
    }
    assert authorize(creds, "", admin) == "admin:alice"
    node: dict[str, object] = {
        "subject": ((("organizationalUnitName", "node"),), (("commonName", "gpu-a"),))
    }
    denied = authorize(creds, "", node)
    assert isinstance(denied, Denied)
    assert denied.status == 403
    assert isinstance(authorize(Credentials(token=None), "Bearer x", None), Denied)


@given(st.text(max_size=40), st.text(max_size=40))
def test_authorize_only_the_token(token_tail: str, given_header: str) -> None:
    token = "k" * 16 + token_tail.strip().replace(" ", "")
    who = authorize(Credentials(token=token), given_header, None)
    assert (who == "token") == (given_header.strip() in (f"Bearer {token}", f"bearer {token}"))


def test_rollout_verdict() -> None:
    def profile(**kw: Any) -> dict[str, Any]:
        return {"profile": "p", "wanted": 1, "replicas": [{"state": "ready"}], **kw}

    assert rollout_verdict({"profiles": [profile()]})[0] == "complete"
    ro = {"revision": "abc", "updated_ready": 0, "wanted": 1, "old": 1, "reason": "x"}
    assert rollout_verdict({"profiles": [profile(rollout={**ro, "state": "stopped"})]})[0] == (
        "stopped"
    )
    assert rollout_verdict({"profiles": [profile(rollout={**ro, "state": "rolling"})]})[0] == (
        "progressing"
    )
    assert rollout_verdict({"profiles": [profile(replicas=[])]})[0] == "progressing"


def test_status_table_shows_the_overrides() -> None:
    o = ops.Ops()
    cat = catalog()
    for verb in (
        ops.Verb("cordon", "a", by="token"),
        ops.Verb("drain", "b", deadline=60.0, by="admin:alice"),
        ops.Verb("scale", "m", replicas=3, by="token"),
        ops.Verb("pause", "m", by="token"),
    ):
        o, _ = ops.apply(o, verb, cat, nodes=["a", "b"], replicas={}, now=100.0)
    (table,) = render_operations({"operations": ops.progress(o, {"r": ["b"]}, 130.0)})
    lines = table.splitlines()
    assert lines[0].split() == ["OVERRIDE", "WHAT", "BY"]
    assert lines[1].split() == ["node", "a", "cordoned", "token"]
    assert "drain draining: 1 replica(s) left, deadline in 30s" in lines[2]
    assert lines[2].endswith("admin:alice")
    assert "3 replicas" in lines[3]
    assert "rollout m" in lines[4]
    assert "paused" in lines[4]
    assert render_operations({"operations": ops.progress(ops.Ops(), {}, 0.0)}) == []


def test_scaled_to_zero_by_an_operator_stays_at_zero_on_demand() -> None:
    cat = catalog(replicas={"min": 0, "max": 2})
    o, _ = ops.apply(
        ops.Ops(), ops.Verb("scale", "m", replicas=0), cat, nodes=[], replicas={}, now=0.0
    )
    spec = ops.effective_catalog(cat, o).get("m", "p")
    assert spec is not None
    scale = ScaleSpec(min=spec.min_replicas, max=spec.max_replicas)
    decision = autoscale(scale, ScaleState(wanted=0), 0, [], 10.0, demand_at=9.0)
    assert decision.wanted == 0
    # Without the override, a router's demand starts one.
    config = ScaleSpec(min=0, max=2)
    assert autoscale(config, ScaleState(wanted=0), 0, [], 10.0, demand_at=9.0).wanted == 1


@given(
    st.integers(1, 5),
    st.sets(st.integers(0, 4)),
    st.integers(0, 8),
    st.booleans(),
)
@settings(max_examples=60, deadline=None)
def test_a_pass_starts_nothing_on_cordoned_or_draining_nodes(
    nodes: int, held: set[int], replicas: int, drain: bool
) -> None:
    names = [f"n{i}" for i in range(nodes)]
    world = World(catalog(replicas=replicas), *(make_node(n, address=f"10.0.0.{i}")
                                                 for i, n in enumerate(names)))  # fmt: skip
    for i in held & set(range(nodes)):
        world.apply(ops.Verb("drain" if drain else "cordon", names[i], deadline=60.0))
    off = {names[i] for i in held if i < nodes}
    for _ in range(3):
        d = world.step()
        assert not {s.node_id for s in starts(d)} & off
        for s in starts(d):
            world.report(s, S.READY)
