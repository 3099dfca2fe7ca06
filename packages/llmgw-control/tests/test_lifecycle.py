"""Rollouts and autoscaling, pure: decision functions and the reconciler applying them."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_control.catalog import Catalog, ModelConfig, build_catalog
from llmgw_control.inventory import GpuSlot, Node, ShardReport
from llmgw_control.reconciler import Settings, reconcile
from llmgw_control.records import ControlState, Drain, Start
from llmgw_control.rollout import ReplicaView, rollout_step
from llmgw_control.scaling import LoadSample, ScaleSpec, ScaleState, autoscale
from llmgw_proto import v1

S = v1.ShardState
SETTINGS = Settings(port_range=(20000, 20999), mgmt_interface="lo", startup_grace=0.0)


# --- rollout_step --------------------------------------------------------------------------

views = st.builds(
    ReplicaView,
    replica_id=st.uuids().map(str),
    ready=st.booleans(),
    placed=st.booleans(),
    failing=st.sampled_from(["", "", "", "exited with code 1"]),
)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 6),
    st.lists(views, max_size=7),
    st.lists(views, max_size=7),
    st.integers(0, 2),
    st.integers(0, 2),
)
def test_rollout_step_bounds(
    wanted: int,
    new: list[ReplicaView],
    old: list[ReplicaView],
    surge: int,
    unavailable: int,
) -> None:
    step = rollout_step(wanted, new, old, surge, unavailable)
    assert set(step.drain) <= {r.replica_id for r in old}
    # Never more than wanted + max_surge replicas, counting what it starts.
    assert step.start == 0 or len(new) + len(old) + step.start <= wanted + surge
    assert len(new) + step.start <= max(wanted, len(new))
    ready_before = sum(r.ready for r in new + old)
    drained_ready = sum(r.ready for r in old if r.replica_id in step.drain)
    # Draining never takes the ready count below wanted - max_unavailable (if it was above).
    if drained_ready:
        assert ready_before - drained_ready >= wanted - unavailable
    if any(r.failing for r in new):
        assert step.state == "stopped"
        assert (step.start, step.drain) == (0, ())
        assert "failed" in step.reason


def simulate(wanted: int, surge: int, unavailable: int) -> list[int]:
    """Drive rollout_step with replicas that get ready one step after they start."""
    old = [ReplicaView(f"o{i}", ready=True, ready_since=float(i)) for i in range(wanted)]
    new: list[ReplicaView] = []
    counter = itertools.count()
    ready_counts = []
    for _ in range(10 * (wanted + 1)):
        step = rollout_step(wanted, new, old, surge, unavailable)
        old = [r for r in old if r.replica_id not in step.drain]
        new = [ReplicaView(r.replica_id, ready=True) for r in new]  # started last step
        new += [ReplicaView(f"n{next(counter)}", ready=False) for _ in range(step.start)]
        ready_counts.append(sum(r.ready for r in new + old))
        if not old and len(new) == wanted and all(r.ready for r in new):
            return ready_counts
    raise AssertionError(f"no convergence: new={new} old={old}")


@given(st.integers(1, 8), st.integers(0, 2), st.integers(0, 2))
def test_a_rollout_converges_and_keeps_enough_ready(
    wanted: int, surge: int, unavailable: int
) -> None:
    if surge == 0 and unavailable == 0:
        return  # refused by the catalog: it could never start
    counts = simulate(wanted, surge, unavailable)
    assert min(counts) >= wanted - unavailable


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 6),
    st.lists(st.tuples(st.booleans(), st.floats(0, 100)), max_size=4),
    st.lists(views, max_size=6),
    st.integers(0, 2),
    st.floats(0, 60),
    st.floats(0, 200),
)
def test_min_ready_starts_nothing_while_a_new_replica_settles(
    wanted: int,
    new_ready: list[tuple[bool, float]],
    old: list[ReplicaView],
    surge: int,
    min_ready: float,
    now: float,
) -> None:
    new = [
        ReplicaView(f"n{i}", ready=ready, ready_since=since)
        for i, (ready, since) in enumerate(new_ready)
    ]
    step = rollout_step(wanted, new, old, surge, 1, now=now, min_ready=min_ready)
    plain = rollout_step(wanted, new, old, surge, 1)
    settling = [r for r in new if min_ready > 0 and r.ready and now - r.ready_since < min_ready]
    if settling:
        assert step.start == 0
        if not step.drain and step.state == "waiting" and not any(r.failing for r in new):
            assert "min_ready" in step.reason or "unplaced" in step.reason
    else:
        assert step.start == plain.start
    # It paces starts only: the drains are those without it.
    assert step.drain == plain.drain


def test_min_ready_paces_a_rollout_one_step_at_a_time() -> None:
    """4 replicas, surge 1: the next new replica starts only once the one before it has
    been ready for min_ready; each gets ready 2 s after it starts."""
    old = [ReplicaView(f"o{i}", ready=True, ready_since=0.0) for i in range(4)]
    new: list[ReplicaView] = []
    started: list[float] = []
    starting: dict[str, float] = {}
    for tick in range(200):
        now = float(tick)
        new = [
            ReplicaView(r.replica_id, ready=True, ready_since=starting[r.replica_id] + 2)
            if not r.ready and now >= starting[r.replica_id] + 2
            else r
            for r in new
        ]
        step = rollout_step(4, new, old, 1, 0, now=now, min_ready=10.0)
        old = [r for r in old if r.replica_id not in step.drain]
        for _ in range(step.start):
            rid = f"n{len(new)}"
            starting[rid] = now
            started.append(now)
            new.append(ReplicaView(rid, ready=False))
        if not old and len(new) == 4 and all(r.ready for r in new):
            break
    assert not old
    # Started at 0, then each 2 s to ready plus 10 s ready before the next.
    assert started == [0.0, 12.0, 24.0, 36.0]


# --- autoscale -----------------------------------------------------------------------------

SPEC = ScaleSpec(min=1, max=6, metric="waiting", target=4.0, up_after=10.0, down_after=30.0)


def test_scale_up_after_the_window_and_say_why() -> None:
    state = ScaleState(wanted=2)
    busy = [LoadSample(running=8, waiting=10, kv_cache_usage=0.9)] * 2
    first = autoscale(SPEC, state, 2, busy, 100.0)
    assert first.wanted == 2  # exceeded, but not for long enough yet
    later = autoscale(SPEC, first.state, 2, busy, 110.0)
    # 36 requests held, 8 run at once per replica: 3 replicas leave 4 waiting each.
    assert later.wanted == 3
    assert "above target 4 for 10s: 2 -> 3" in later.reason


def test_no_more_while_the_replicas_it_asked_for_start() -> None:
    state = ScaleState(wanted=2)
    busy = [LoadSample(running=8, waiting=10, kv_cache_usage=0.9)] * 2
    d = autoscale(SPEC, state, 2, busy, 0.0)
    d = autoscale(SPEC, d.state, 2, busy, 10.0)
    assert d.wanted == 3
    # Still 2 ready (the third starts): the load needs 3, which are wanted already.
    d = autoscale(SPEC, d.state, 2, busy, 40.0)
    assert d.wanted == 3
    assert "3 wanted" in d.reason


def test_running_requests_count_when_judging_fewer() -> None:
    # Issue 24 point 12: 3 replicas each running 8 with nothing waiting. Two would
    # carry the 24 requests with 4 waiting each: not under the target 4, so no drain
    # (the old rule looked at waiting only, 0, and drained one).
    state = ScaleState(wanted=3)
    full = [LoadSample(running=8, waiting=0, kv_cache_usage=0.5)] * 3
    d = autoscale(SPEC, state, 3, full, 0.0)
    for now in (30.0, 60.0, 600.0):
        d = autoscale(SPEC, d.state, 3, full, now)
        assert d.wanted == 3
        assert "within target" in d.reason
    # Less load: 18 held, 6 seen running at once, so two would leave 3 waiting each;
    # under the target, so one fewer after down_after.
    lighter = [LoadSample(running=6, waiting=0, kv_cache_usage=0.3)] * 3
    d = autoscale(SPEC, d.state, 3, lighter, 700.0)
    assert d.wanted == 3
    assert "2 replicas would show waiting 3" in d.reason
    d = autoscale(SPEC, d.state, 3, lighter, 730.0)
    assert d.wanted == 2


def test_scale_down_one_at_a_time_after_the_cool_down() -> None:
    state = ScaleState(wanted=4)
    calm = [LoadSample(running=1, waiting=0, kv_cache_usage=0.1)] * 4
    d = autoscale(SPEC, state, 4, calm, 0.0)
    assert d.wanted == 4
    d = autoscale(SPEC, d.state, 4, calm, 29.0)
    assert d.wanted == 4
    d = autoscale(SPEC, d.state, 4, calm, 30.0)
    assert d.wanted == 3
    assert "(by drain)" in d.reason


def test_scale_to_zero_and_back_on_demand() -> None:
    spec = ScaleSpec(min=0, max=2, idle_after=60.0)
    idle = [LoadSample(running=0, waiting=0, kv_cache_usage=0.0)]
    d = autoscale(spec, ScaleState(wanted=1), 1, idle, 0.0)
    assert d.wanted == 1
    d = autoscale(spec, d.state, 1, idle, 60.0)
    assert d.wanted == 0
    d = autoscale(spec, d.state, 0, [], 61.0)
    assert d.wanted == 0
    d = autoscale(spec, d.state, 0, [], 70.0, demand_at=69.0)
    assert d.wanted == 1
    assert "demand" in d.reason


def test_scale_to_zero_exactly_idle_after_the_last_demand() -> None:
    # Issue 24 point 13: with idle_after 15 s the drain came at 30.9 s; demand at 0,
    # nothing running from then on, a pass each second: zero at 15, not before.
    spec = ScaleSpec(min=0, max=2, idle_after=15.0)
    idle = [LoadSample(running=0, waiting=0, kv_cache_usage=0.0)]
    d = autoscale(spec, ScaleState(wanted=1), 1, idle, 0.0, demand_at=0.0)
    zero_at = None
    for now in range(1, 31):
        d = autoscale(spec, d.state, 1, idle, now, demand_at=0.0)
        if d.wanted == 0:
            zero_at = now
            assert "idle for 15s" in d.reason
            break
    assert zero_at == 15


def test_idle_counts_from_the_last_request_when_demand_is_older() -> None:
    spec = ScaleSpec(min=0, max=2, idle_after=15.0)
    busy = [LoadSample(running=1, waiting=0, kv_cache_usage=0.1)]
    idle = [LoadSample(running=0, waiting=0, kv_cache_usage=0.0)]
    d = autoscale(spec, ScaleState(wanted=1), 1, busy, 0.0, demand_at=0.0)
    d = autoscale(spec, d.state, 1, busy, 40.0, demand_at=0.0)
    d = autoscale(spec, d.state, 1, idle, 41.0, demand_at=0.0)  # first idle pass
    d = autoscale(spec, d.state, 1, idle, 55.0, demand_at=0.0)
    assert d.wanted == 1
    d = autoscale(spec, d.state, 1, idle, 56.0, demand_at=0.0)
    assert d.wanted == 0


@settings(max_examples=300, deadline=None)
@given(
    st.floats(0.5, 300.0),
    st.lists(st.floats(0.0, 100.0), min_size=1, max_size=20),
    st.floats(0.0, 100.0),
)
def test_zero_after_idle_after_of_no_demand_not_later(
    idle_after: float, gaps: list[float], tail: float
) -> None:
    """Demand at some times, nothing running: zero at the first pass at or past
    ``idle_after`` after the last demand, never before."""
    spec = ScaleSpec(min=0, max=3, idle_after=idle_after)
    idle = [LoadSample(running=0, waiting=0, kv_cache_usage=0.0)]
    state = ScaleState(wanted=1)
    now = 0.0
    for gap in gaps:
        now += gap
        d = autoscale(spec, state, 1, idle, now, demand_at=now)
        assert d.wanted == 1
        state = d.state
    last = now
    # Passes every second after the last demand.
    t = last
    while t < last + idle_after + tail:
        t += 1.0
        d = autoscale(spec, state, 1, idle, t, demand_at=last)
        if t - last < idle_after:
            assert d.wanted == 1
        else:
            assert d.wanted == 0
            break
        state = d.state


def _even(load: float, n: int, capacity: int, metric: str) -> list[LoadSample]:
    """A router spreading a constant load evenly over ``n`` replicas."""
    if metric == "kv_cache":
        use = min(1.0, load / n)
        return [LoadSample(running=0, waiting=0, kv_cache_usage=use)] * n
    whole = int(load)
    out = []
    for i in range(n):
        share = whole // n + (1 if i < whole % n else 0)
        run = min(share, capacity)
        out.append(LoadSample(running=run, waiting=share - run, kv_cache_usage=0.0))
    return out


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["waiting", "kv_cache"]),
    st.integers(1, 3),
    st.integers(0, 8),
    st.integers(0, 8),
    st.floats(0.0, 200.0),
    st.integers(1, 16),
    st.integers(1, 8),
    st.floats(0.3, 0.95),
    st.integers(0, 3),
    st.floats(1.0, 20.0),
)
def test_under_a_constant_load_no_decisions_oscillate(
    metric: str,
    low: int,
    span: int,
    start: int,
    load: float,
    capacity: int,
    waiting_target: int,
    kv_target: float,
    lag: int,
    step: float,
) -> None:
    """Issue 24 point 12: whatever count it starts at, a constant load moves the count
    one way only (up, or down), never up then down or down then up, and it settles
    where the load fits: at or under the target, or at max."""
    target = kv_target if metric == "kv_cache" else float(waiting_target)
    if metric == "kv_cache":
        load = load / 25.0  # in replicas' worth of KV cache: 0..8
    spec = ScaleSpec(
        min=low, max=low + span, metric=metric, target=target, up_after=30.0, down_after=60.0
    )
    state = ScaleState(wanted=min(low + start, low + span))
    ready = state.wanted
    starting: list[tuple[int, int]] = []  # (pass it is ready at, count)
    counts = [state.wanted]
    # Long enough for every step down (or up) the count can take, and then some.
    passes = int((span + 2) * (spec.down_after + spec.up_after + 2 * step) / step) + 3 * lag
    for i in range(passes):
        now = i * step
        # New replicas become ready ``lag`` passes after they are wanted; drains are
        # immediate (a draining replica is no longer ready).
        ready = min(ready, state.wanted)
        for due, n in list(starting):
            if due <= i:
                ready = min(state.wanted, ready + n)
                starting.remove((due, n))
        d = autoscale(spec, state, ready, _even(load, ready, capacity, metric), now)
        if d.wanted > state.wanted:
            starting.append((i + lag, d.wanted - state.wanted))
        state = d.state
        counts.append(d.wanted)
    moves = [b - a for a, b in itertools.pairwise(counts) if b != a]
    assert all(m > 0 for m in moves) or all(m < 0 for m in moves), counts
    settled = autoscale(spec, state, state.wanted, _even(load, state.wanted, capacity, metric), 1e9)
    assert settled.wanted == state.wanted, (counts, settled.reason)
    if state.wanted < spec.max:
        assert settled.metric is not None
        assert settled.metric <= target, settled.reason


samples = st.lists(
    st.builds(
        LoadSample,
        running=st.integers(0, 20),
        waiting=st.integers(0, 40),
        kv_cache_usage=st.floats(0, 1),
    ),
    max_size=6,
)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 3),
    st.integers(1, 8),
    st.sampled_from(["waiting", "kv_cache"]),
    st.lists(st.tuples(samples, st.floats(0, 50), st.booleans()), max_size=12),
)
def test_autoscale_stays_in_bounds_and_moves_down_by_one(
    low: int, span: int, metric: str, script: list[tuple[list[LoadSample], float, bool]]
) -> None:
    spec = ScaleSpec(
        min=low, max=low + span, metric=metric, target=0.8 if metric == "kv_cache" else 4.0
    )
    state = ScaleState(wanted=low)
    now = 0.0
    for figures, dt, demand in script:
        now += dt
        ready = min(state.wanted, len(figures)) if figures else state.wanted
        d = autoscale(spec, state, ready, figures, now, demand_at=now if demand else None)
        assert spec.min <= d.wanted <= spec.max or (spec.min == 0 and d.wanted == 0)
        assert d.wanted <= spec.max
        # Down only one at a time (by drain), except idle to zero.
        if d.wanted < state.wanted:
            assert d.wanted == state.wanted - 1 or d.wanted == 0
        assert d.reason
        state = d.state


# --- the reconciler rolling a changed profile -------------------------------------------


def catalog(**profile: Any) -> Catalog:
    fields = {"engine": "vllm", "gpus_per_node": 1, "replicas": 3, **profile}
    models = msgspec.convert([{"name": "m", "profiles": {"p": fields}}], list[ModelConfig])
    return build_catalog(models, "control.yaml")


def test_reconciler_rolls_a_changed_profile_without_losing_ready_replicas() -> None:
    nodes = {
        n: Node(
            n,
            "s1",
            gpus=(GpuSlot(0, "g", 1), GpuSlot(1, "g", 1)),
            interfaces={"lo": [f"10.0.0.{i}"]},
        )
        for i, n in enumerate(["a", "b", "c"])
    }
    ids = (f"m.p.{i:08x}" for i in itertools.count())
    state = ControlState()
    now = 10.0

    def run(cat: Catalog, fail_new: bool = False) -> None:
        nonlocal state, now
        now += 1.0
        d = reconcile(cat, nodes, state, now, SETTINGS, lambda m, p: next(ids))
        state = d.state
        for c in d.commands:
            node = nodes[c.node_id]
            if isinstance(c, Start):
                node.shards[c.shard_id] = ShardReport(
                    c.shard_id, c.replica_id, S.FAILED if fail_new else S.READY,
                    model="m", profile="p", gpu_indices=c.gpu_indices, port=c.port,
                    reason="bad flag --nope" if fail_new else "",
                )  # fmt: skip
            elif isinstance(c, Drain):
                node.shards[c.shard_id].state = S.STOPPED

    v1_cat = catalog()
    for _ in range(4):
        run(v1_cat)
    assert sum(r.ready_since is not None for r in state.replicas.values()) == 3
    first_ids = set(state.replicas)

    # A new revision whose replica fails: the rollout stops, the old three serve on.
    bad = catalog(engine_args=["--nope"])
    for _ in range(6):
        run(bad, fail_new=True)
        ready_old = [
            r for r in state.replicas.values() if r.replica_id in first_ids and not r.draining
        ]
        assert len(ready_old) == 3
    d = reconcile(bad, nodes, state, now, SETTINGS, lambda m, p: next(ids))
    assert d.rollouts[("m", "p")]["state"] == "stopped"
    assert "bad flag --nope" in d.rollouts[("m", "p")]["reason"]

    # A good change rolls through: never fewer than 3 ready and not draining.
    good = catalog(engine_args=["--max-model-len", "4096"])
    for _ in range(30):
        run(good)
        serving = [
            r for r in state.replicas.values() if r.ready_since is not None and not r.draining
        ]
        assert len(serving) >= 3
    live = [r for r in state.replicas.values() if not r.draining]
    assert len(live) == 3
    assert all(r.revision == good.profiles[0].revision for r in live)
    assert not first_ids & {r.replica_id for r in live}

    # Only the count changes: it scales, nothing is replaced.
    before = {r.replica_id for r in live}
    more = catalog(engine_args=["--max-model-len", "4096"], replicas=4)
    for _ in range(3):
        run(more)
    after = {r.replica_id for r in state.replicas.values() if not r.draining}
    assert before < after
    assert len(after) == 4
