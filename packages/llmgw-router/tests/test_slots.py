"""Slots (issue 28 point 3): cache_aware ranks an endpoint by its slot where set, so a
replica that replaces another in its slot (a rolling update) inherits exactly its
prefixes and nothing else moves; warming then plans the leaving replica's prompts for
its successor, and nothing at the join."""

from __future__ import annotations

import zlib
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_proto import v1
from llmgw_router.balancing.cache_aware import CacheAware
from llmgw_router.balancing.index import endpoint_ident
from llmgw_router.config import RouterConfig
from llmgw_router.control.watch import spec_from_wire
from llmgw_router.endpoints import Endpoint, EndpointSet, EndpointSpec
from llmgw_router.metrics import Metrics
from llmgw_router.proxy.warm import Warmer
from llmgw_router.state import RouterState
from llmgw_testkit.candidates import Cand

PATH = "/v1/completions"


def ep(ident: str, slot: str = "", leaving: bool = False) -> Endpoint:
    return Endpoint(spec=spec(ident, slot, leaving))


def spec(ident: str, slot: str = "", leaving: bool = False) -> EndpointSpec:
    return EndpointSpec(
        id=ident, url=f"http://{ident}:1", models=("m",), slot=slot, leaving=leaving
    )


def homes(balancer: CacheAware[Endpoint], eps: list[Endpoint], keys: list[int]) -> list[str]:
    return [balancer.ranking(eps, (7, k))[0].id for k in keys]


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 6),
    st.data(),
    st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=80, unique=True),
)
def test_a_replacement_in_a_slot_takes_exactly_its_predecessors_prefixes(
    n: int, data: st.DataObject, keys: list[int]
) -> None:
    j = data.draw(st.integers(0, n - 1))
    balancer: CacheAware[Endpoint] = CacheAware()
    before = [ep(f"old{i}", f"m/p/{i}") for i in range(n)]
    after = [e if i != j else ep("new", f"m/p/{j}") for i, e in enumerate(before)]
    was, now = homes(balancer, before, keys), homes(balancer, after, keys)
    for k, a, b in zip(keys, was, now, strict=True):
        assert b == ("new" if a == f"old{j}" else a), k


def test_without_slots_a_replacement_takes_a_share_of_every_endpoints_prefixes() -> None:
    """By id (no slot, or use_slots off), the newcomer is the first choice of a fresh
    quarter of all prefixes: others' move too (what slots avoid)."""
    keys = list(range(400))
    balancers: list[tuple[CacheAware[Endpoint], str]] = [
        (CacheAware(), ""),
        (CacheAware(use_slots=False), "s"),
    ]
    for balancer, slot in balancers:
        before = [ep(f"old{i}", f"{slot}{i}" if slot else "") for i in range(4)]
        after = [*before[1:], ep("new", f"{slot}0" if slot else "")]
        was, now = homes(balancer, before, keys), homes(balancer, after, keys)
        moved_from_others = [
            k for k, a, b in zip(keys, was, now, strict=True) if a != "old0" and a != b
        ]
        assert len(moved_from_others) > 40


def test_of_two_endpoints_in_one_slot_the_one_ranked_first_before_stays_first() -> None:
    """While the old replica serves (not leaving yet) the newcomer in its slot ranks
    right after it (first seen first), so nothing moves at the join; when the old one
    goes, the newcomer is first for exactly its prefixes."""
    balancer: CacheAware[Endpoint] = CacheAware()
    fleet = [ep("zz-old", "m/p/0"), ep("b", "m/p/1"), ep("c", "m/p/2")]
    keys = list(range(300))
    was = homes(balancer, fleet, keys)
    # "aa-new" sorts before "zz-old" by id: the order is not the ids'.
    joined = [*fleet, ep("aa-new", "m/p/0")]
    for k, home in zip(keys, was, strict=True):
        order = [e.id for e in balancer.ranking(joined, (7, k))]
        assert order[0] == home
        if home == "zz-old":
            assert order[1] == "aa-new"
    assert homes(balancer, joined[1:], keys) == ["aa-new" if h == "zz-old" else h for h in was]


def test_the_slot_comes_from_the_wire_and_a_static_endpoint_may_set_it() -> None:
    wire = v1.Endpoint(id="r1", url="http://10.0.0.1:9", model="m", slot="m/p/3")
    assert spec_from_wire(wire).slot == "m/p/3"
    assert spec_from_wire(v1.Endpoint(id="r1", url="http://10.0.0.1:9", model="m")).slot == ""
    cfg = msgspec.convert(
        {"endpoints": [{"id": "a", "url": "http://h:1", "models": ["m"], "slot": "s0"}]},
        RouterConfig,
    )
    assert cfg.endpoints[0].slot == "s0"
    assert msgspec.convert({}, RouterConfig).cache_aware.use_slots


class _Ctx:
    def __init__(self, key: int, size: int) -> None:
        self.prefix = (7, key)
        self.body = msgspec.json.encode({"model": "m", "prompt": "x" * size})
        self.model = "m"
        self.path = PATH


def fleet(specs: list[EndpointSpec], config: dict[str, Any]) -> tuple[RouterState, Warmer]:
    cfg = msgspec.convert(
        {"warming": {"max_requests": 256, "max_prefill_fraction": 1.0}, **config},
        RouterConfig,
    )
    state = RouterState(cfg, EndpointSet(Endpoint(spec=s) for s in specs), Metrics())
    return state, Warmer(state, object(), cfg.warming)  # type: ignore[arg-type]


def swap(state: RouterState, specs: list[EndpointSpec]) -> None:
    state.swap(state.endpoints.successor(specs, version=2, source="test"))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 200), min_size=1, max_size=80))
def test_a_rollout_step_warms_the_successor_with_the_leaving_replicas_prompts_only(
    sends: list[int],
) -> None:
    ids = ["r0", "r1", "r2", "r3"]
    specs = [spec(i, f"m/p/{n}") for n, i in enumerate(ids)]
    state, warmer = fleet(specs, {})
    balancer = state.balancer
    assert isinstance(balancer, CacheAware)
    # Each prompt sent to its home (its first rendezvous choice).
    for key in sends:
        home = homes(balancer, list(state.endpoints.endpoints), [key])[0]
        warmer.recent.note(home, _Ctx(key, 400))  # type: ignore[arg-type]
    # The successor of r0 joins in its slot: it is the first choice of nothing yet.
    swap(state, [*specs, spec("new", "m/p/0")])
    assert warmer._change_plan([state.endpoints.by_id["new"]], []) == []
    # r0 leaves: exactly its sampled prompts move, all to its successor.
    swap(state, [spec("r0", "m/p/0", leaving=True), *specs[1:], spec("new", "m/p/0")])
    warmer.leaving = frozenset({"r0"})
    jobs = warmer._change_plan([], [state.endpoints.by_id["r0"]])
    theirs = {h.key for h in warmer.recent.hot("r0")}
    assert {t.id for t, _ in jobs} <= {"new"}
    # Within its budget (its own recent prefill, fraction 1), all of them.
    assert {h.key for _, h in jobs} == theirs


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 6), st.data(), st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=40))
def test_any_candidate_is_ranked_by_its_slot(n: int, data: st.DataObject, keys: list[int]) -> None:
    """The slot is part of the candidate protocol (LoadedCandidate.slot), not only an
    Endpoint's: a test candidate named "x" in slot "c1" ranks exactly where "c1" does."""
    j = data.draw(st.integers(0, n - 1))
    balancer: CacheAware[Cand] = CacheAware()
    plain = [Cand(f"c{i}") for i in range(n)]
    slotted = [c if i != j else Cand("x", slot=f"c{j}") for i, c in enumerate(plain)]
    for k in keys:
        was = [c.id for c in balancer.ranking(plain, (7, k))]
        now = [c.id for c in balancer.ranking(slotted, (7, k))]
        assert now == ["x" if e == f"c{j}" else e for e in was]


def test_the_first_ranked_order_stays_bounded_as_endpoints_come_and_go() -> None:
    """3,000 fleets of 4 new endpoints each (12,000 ids): what the balancer keeps of
    their order stays within its limit (it kept every id it ever ranked)."""
    balancer: CacheAware[Cand] = CacheAware()
    born = balancer._born
    most = 0
    for r in range(3000):
        balancer.ranking([Cand(f"e{r}.{i}") for i in range(4)], (7, r))
        most = max(most, len(born.ranks))
    assert born.limit // 2 < most < born.limit + 4


@settings(max_examples=200, deadline=None)
@given(
    st.integers(2, 8),
    st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=8, unique=True), max_size=40),
)
def test_dropping_gone_endpoints_keeps_the_order_of_the_rest(
    limit: int, fleets: list[list[int]]
) -> None:
    """At the limit the oldest endpoints that are not candidates are dropped (all but
    the newest half of the limit): the candidates and what is kept keep their order (of
    two in one slot, the one first ranked stays first), and what is kept stays within
    the limit plus the candidates."""
    balancer: CacheAware[Cand] = CacheAware()
    born = balancer._born
    born.limit = limit
    for ids in fleets:
        ready = [Cand(f"e{i}", slot=f"s{i % 3}") for i in ids]
        before = sorted(born.ranks, key=born.ranks.__getitem__)
        balancer.ranking(ready, (7, len(before)))
        after = sorted(born.ranks, key=born.ranks.__getitem__)
        new = [c.id for c in ready if c.id not in before]
        assert after == [e for e in before if e in born.ranks] + new
        assert {c.id for c in ready} <= set(after)
        assert len(set(born.ranks.values())) == len(after)
        assert len(after) < limit + len(ready)
        # Dropped: none below the limit, else all but the newest half-limit others.
        here = {c.id for c in ready}
        others = [e for e in before if e not in here]
        kept = others[-(limit // 2) :] if len(before) >= limit else others
        assert [e for e in after if e not in here] == kept


@given(st.text(min_size=1, max_size=40))
def test_an_endpoint_ident_is_the_same_in_every_process(endpoint_id: str) -> None:
    # The rendezvous identity every router computes alike: crc32 low, adler32 high.
    raw = endpoint_id.encode()
    assert endpoint_ident(endpoint_id) == zlib.crc32(raw) | (zlib.adler32(raw) << 32)


def test_the_endpoint_idents_kept_are_bounded() -> None:
    # Ids come and go with every replica replaced: the identities kept stay bounded
    # (a dict per balancer kept every id ever ranked).
    for i in range(5000):
        endpoint_ident(f"churn-{i}")
    assert endpoint_ident.cache_info().currsize <= 4096
