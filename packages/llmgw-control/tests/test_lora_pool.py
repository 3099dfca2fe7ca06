"""LoRA placement's spare pool (issue 30): a cold adapter's first requests evict only one of
the fleet's least used adapters, or one used less than it; the hot ones stay pinned until
its requests have waited ``patience``."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_control.lora import HELD_TTL, RATE_FLOOR, RATE_WINDOW, LoraManager
from llmgw_control.lora_plan import Action, Demand, ReplicaView, plan, pool_size
from prometheus_client import CollectorRegistry


def _full() -> tuple[list[ReplicaView], dict[str, Demand]]:
    reps = [
        ReplicaView("a", 0, 2, frozenset({"hot1", "hot2"})),
        ReplicaView("b", 0, 2, frozenset({"hot3", "tail"})),
    ]
    demand = {
        "hot1": Demand(rate=3.0, last_used=10),
        "hot2": Demand(rate=1.0, last_used=10),
        "hot3": Demand(rate=0.5, last_used=10),
        # The least used, but used just now: min_idle keeps it.
        "tail": Demand(rate=0.02, last_used=99),
    }
    return reps, demand


def test_a_cold_adapter_waits_for_the_spare_slot_rather_than_unload_a_hot_one() -> None:
    reps, demand = _full()
    demand["new"] = Demand(held=1, rate=0.02, last_used=100, held_for=1.0)
    assert plan(reps, demand, now=100.0, min_idle=5.0, patience=3.0, spare=1) == []
    # Without the pool (the old rule) the least used movable one goes: a hot one.
    assert plan(reps, demand, now=100.0, min_idle=5.0) == [
        Action("unload", "b", "hot3"),
        Action("load", "b", "new"),
    ]
    # The spare slot's adapter idle for min_idle: it goes.
    demand["tail"] = Demand(rate=0.02, last_used=90)
    assert plan(reps, demand, now=100.0, min_idle=5.0, patience=3.0, spare=1) == [
        Action("unload", "b", "tail"),
        Action("load", "b", "new"),
    ]


def test_after_patience_a_cold_adapter_evicts_the_least_used_idle_one() -> None:
    reps, demand = _full()
    demand["new"] = Demand(held=2, rate=0.02, last_used=100, held_for=3.5)
    assert plan(reps, demand, now=100.0, min_idle=5.0, patience=3.0, spare=1) == [
        Action("unload", "b", "hot3"),
        Action("load", "b", "new"),
    ]


def test_each_patience_waited_widens_the_pool_by_the_next_least_used() -> None:
    reps, demand = _full()
    # hot3 busy (used within min_idle): one patience waited lets the pool take in hot3
    # (the tail aside, the least used), not yet hot2 or hot1.
    demand["hot3"] = Demand(rate=0.5, last_used=99)
    demand["new"] = Demand(held=2, rate=0.02, last_used=100, held_for=3.5)
    assert plan(reps, demand, now=100.0, min_idle=5.0, patience=3.0, spare=1) == []
    # Two: hot2 (the next least used) may go; hot1, the most used, stays.
    demand["new"] = Demand(held=2, rate=0.02, last_used=100, held_for=6.5)
    assert plan(reps, demand, now=100.0, min_idle=5.0, patience=3.0, spare=1) == [
        Action("unload", "a", "hot2"),
        Action("load", "a", "new"),
    ]


def test_an_adapter_used_more_than_a_pinned_one_may_evict_it() -> None:
    reps, demand = _full()
    # Back after an eviction, and asked for more than hot3 is.
    demand["back"] = Demand(held=1, rate=0.8, last_used=100, held_for=0.5)
    assert plan(reps, demand, now=100.0, min_idle=5.0, patience=3.0, spare=1) == [
        Action("unload", "b", "hot3"),
        Action("load", "b", "back"),
    ]


def test_a_free_slot_is_taken_whatever_the_pool() -> None:
    reps = [ReplicaView("a", 0, 2, frozenset({"hot1"}))]
    demand = {"hot1": Demand(rate=3.0, last_used=99), "new": Demand(held=1, last_used=100)}
    assert plan(reps, demand, now=100.0, min_idle=5.0, patience=3.0, spare=1) == [
        Action("load", "a", "new")
    ]


names = st.sampled_from([f"l{i}" for i in range(8)])
replica = st.builds(
    lambda i, cap, held: ReplicaView(f"r{i}", 0.0, cap, frozenset(list(held)[:cap])),
    st.integers(0, 4),
    st.integers(0, 3),
    st.frozensets(names, max_size=4),
)
demand = st.dictionaries(
    names,
    st.builds(
        Demand,
        st.integers(0, 2),
        st.floats(0, 5),
        st.floats(0, 100),
        st.sampled_from([0.0, 1.0, 5.0]),
    ),
    max_size=8,
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(replica, max_size=4).map(lambda rs: list({r.id: r for r in rs}.values())),
    demand,
    st.integers(0, 4),
    st.sampled_from([0.0, 3.0]),
    st.sampled_from([0.0, 10.0]),
    st.sampled_from([0.0, 1.0, 4.0]),
)
def test_pool_properties(
    reps: list[ReplicaView],
    wants: dict[str, Demand],
    spare: int,
    patience: float,
    idle: float,
    turn: float,
) -> None:
    now = 100.0
    actions = plan(reps, wants, now=now, min_idle=idle, patience=patience, spare=spare, turn=turn)
    taken = {r.id: set(r.taken) for r in reps if r.capacity > 0}
    slots = sum(r.capacity for r in reps if r.capacity > 0)
    size = pool_size(slots, [d.rate for d in wants.values()], spare, turn)

    def used(a: str) -> tuple[float, float, str]:
        d = wants.get(a, Demand())
        return (d.rate, d.last_used, a)

    for i, act in enumerate(actions):
        if act.kind == "unload":
            # An unload makes room for the load that follows it, on the same replica.
            nxt = actions[i + 1]
            assert (nxt.kind, nxt.replica) == ("load", act.replica)
            new = wants.get(nxt.adapter, Demand())
            everyone = sorted({a for t in taken.values() for a in t}, key=used)
            # Only one of the spare pool, widened by one for each patience the newcomer's
            # requests waited, or one used less (without patience, any).
            widen = int(new.held_for // patience) if patience > 0 else len(everyone)
            assert (
                act.adapter in everyone[: size + widen]
                or wants.get(act.adapter, Demand()).rate < new.rate
            )
            assert wants.get(act.adapter, Demand()).held == 0
            assert idle <= 0 or now - wants.get(act.adapter, Demand()).last_used >= idle
            taken[act.replica].discard(act.adapter)
        else:
            assert act.adapter not in taken[act.replica]
            taken[act.replica].add(act.adapter)
    by_id = {r.id: r for r in reps}
    for rid, held in taken.items():
        assert len(held) <= max(by_id[rid].capacity, len(by_id[rid].taken))
    # An adapter with requests held and no holder gets a slot when one is free, pool or not.
    waiting = [a for a, d in wants.items() if d.held and not any(a in r.taken for r in reps)]
    free = any(len(r.taken) < r.capacity for r in reps)
    if waiting and free:
        assert any(a.kind == "load" and a.adapter in waiting for a in actions)
    # After its patience, the old rule's liveness holds: any idle adapter may go.
    patient = [a for a in waiting if wants[a].held_for >= patience]
    movable = any(
        wants.get(a, Demand()).held == 0
        and (idle <= 0 or now - wants.get(a, Demand()).last_used >= idle)
        for r in reps
        if r.capacity > 0
        for a in r.taken
    )
    if patient and movable:
        assert any(a.kind == "load" and a.adapter in waiting for a in actions)


@given(
    st.integers(0, 40),
    st.lists(st.floats(0, 10), max_size=40),
    st.integers(0, 40),
    st.floats(0, 20),
)
def test_pool_size_properties(slots: int, rates: list[float], spare: int, turn: float) -> None:
    n = pool_size(slots, rates, spare, turn)
    assert min(spare, slots) <= n <= max(min(spare, slots), slots)
    ordered = sorted(rates, reverse=True)
    left_out = sum(ordered[slots - n :])
    # Big enough for the turns the left-out adapters ask for, unless it is every slot.
    assert n == slots or left_out * turn <= n
    # And the smallest such: one fewer would not be (unless it is the floor, spare).
    if n > min(spare, slots):
        assert sum(ordered[slots - (n - 1) :]) * turn > n - 1


def test_pool_grows_with_the_tail_demand() -> None:
    # 16 slots, 8 busy adapters and 12 asked for once every 10 s: the 4 least used left
    # out take turns of 4 s: 4 x 0.1 x 4 = 1.6 slots, so the floor, 4, is enough.
    assert pool_size(16, [1.0] * 8 + [0.1] * 12, 4, 4.0) == 4
    # 6 busy and 20 at 0.1/s: 4 spare slots leave 14 out (1.4/s x 4 s = 5.6 slots); 7
    # leave 17 out (6.8 slots): the smallest that is enough.
    assert pool_size(16, [1.0] * 6 + [0.1] * 20, 4, 4.0) == 7
    assert pool_size(16, [1.0] * 6 + [0.1] * 20, 4, 0.0) == 4
    # More demand left out than all the slots can take turns for: every slot.
    assert pool_size(16, [1.0] * 8 + [0.1] * 30, 4, 4.0) == 16


def test_a_rate_is_over_the_time_since_the_first_report_while_shorter_than_the_window() -> None:
    mgr = LoraManager(CollectorRegistry())
    mgr.on_demand("x", held=0, requests=30, now=1000.0)
    mgr.on_demand("y", held=0, requests=0, now=1000.0)
    # 30 requests in the first minute: 0.5/s, not 30 over the whole window.
    assert mgr.demand["x"].view(1060.0, mgr.since).rate == 0.5
    # Never under RATE_FLOOR: 30 requests in the first second are not 30 a second.
    assert mgr.demand["x"].view(1001.0, mgr.since).rate == 30 / RATE_FLOOR
    # Once the window has passed, over the window; counts older than it are dropped.
    assert mgr.demand["x"].view(1000.0 + RATE_WINDOW, mgr.since).rate == 30 / RATE_WINDOW
    assert mgr.demand["x"].view(1001.0 + RATE_WINDOW, mgr.since).rate == 0.0
    assert mgr.demand["y"].view(1060.0, mgr.since).rate == 0.0


def test_the_manager_counts_how_long_requests_have_been_held() -> None:
    mgr = LoraManager(CollectorRegistry())
    mgr.on_demand("x", held=1, requests=1, now=10.0)
    mgr.on_demand("x", held=2, requests=0, now=12.0)
    assert mgr.demand["x"].view(12.5).held_for == 2.5
    # Released (a report of none held), then held again: counted from then.
    mgr.on_demand("x", held=0, requests=1, now=13.0)
    assert mgr.demand["x"].view(13.0).held_for == 0.0
    mgr.on_demand("x", held=1, requests=1, now=14.0)
    assert mgr.demand["x"].view(15.0).held_for == 1.0
    # No router repeated it for HELD_TTL: forgotten, and a new hold starts afresh.
    later = 14.0 + HELD_TTL + 1
    assert mgr.demand["x"].view(later).held_for == 0.0
    mgr.on_demand("x", held=1, requests=0, now=later)
    assert mgr.demand["x"].view(later + 1).held_for == 1.0
