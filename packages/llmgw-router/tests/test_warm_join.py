"""A replica that joins warm (proxy/warm.py, issue 28 point 3): the samples merged (pure),
the newcomer's plan against the real rendezvous ranking, and its hold: held out of the
picks until its copies are answered, a leaving endpoint kept meanwhile."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_router.balancing.cache_aware import CacheAware
from llmgw_router.config import RouterConfig
from llmgw_router.endpoints import Endpoint, EndpointSet, EndpointSpec
from llmgw_router.metrics import Metrics
from llmgw_router.proxy.warm import Hot, Warmer, merged
from llmgw_router.state import RouterState

PATH = "/v1/completions"


def hot(key: int, uses: int = 1, tokens: int = 100, body: bytes = b"{}") -> Hot:
    return Hot(key, "m", PATH, body, (7, key), tokens, uses)


@given(
    st.lists(
        st.lists(st.tuples(st.integers(0, 12), st.integers(1, 9)), max_size=12),
        max_size=4,
    )
)
def test_merged_sums_the_uses_of_a_prompt_held_on_several_endpoints(
    lists: list[list[tuple[int, int]]],
) -> None:
    samples = [
        [hot(k, u, body=f"{i}".encode()) for k, u in dict(sample).items()]
        for i, sample in enumerate(lists)
    ]
    out = merged(samples)
    keys = [h.key for h in out]
    assert len(keys) == len(set(keys))
    assert keys == list(dict.fromkeys(h.key for s in samples for h in s))
    for h in out:
        assert h.uses == sum(x.uses for s in samples for x in s if x.key == h.key)
        # The body of the last list carrying it.
        assert h.body == [x.body for s in samples for x in s if x.key == h.key][-1]
    # The inputs are left as they were.
    assert [[(h.key, h.uses) for h in s] for s in samples] == [
        list(dict(sample).items()) for sample in lists
    ]


class _Ctx:
    def __init__(self, key: int, size: int) -> None:
        self.prefix = (7, key)
        self.body = msgspec.json.encode({"model": "m", "prompt": "x" * size})
        self.model = "m"
        self.path = PATH


class _Response:
    status = 200

    async def read(self) -> bytes:
        return b"{}"

    def release(self) -> None:
        pass


class _Pool:
    """Answers each warm copy once ``gate`` is set; records where each went."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.sent: list[str] = []
        # Set once as many copies are sent as warming.concurrency lets go at once.
        self.started = asyncio.Event()

    async def post(self, url: str, path: str, body: bytes, *args: Any, **kw: Any) -> _Response:
        self.sent.append(url)
        if len(self.sent) >= 2:
            self.started.set()
        await self.gate.wait()
        return _Response()


def spec(ident: str, leaving: bool = False) -> EndpointSpec:
    return EndpointSpec(id=ident, url=f"http://{ident}:1", models=("m",), leaving=leaving)


def fleet(
    ids: list[str], pool: Any, config: dict[str, Any] | None = None
) -> tuple[RouterState, Warmer]:
    cfg = msgspec.convert(
        {"warming": {"max_requests": 64, "max_prefill_fraction": 1.0, **(config or {})}},
        RouterConfig,
    )
    state = RouterState(cfg, EndpointSet(Endpoint(spec=spec(i)) for i in ids), Metrics())
    return state, Warmer(state, pool, cfg.warming)


def swap(state: RouterState, specs: list[EndpointSpec]) -> None:
    state.swap(state.endpoints.successor(specs, version=2, source="test"))


def first_choice(state: RouterState, ids: list[str], key: int) -> str:
    balancer = state.balancer
    assert isinstance(balancer, CacheAware)
    eps = [ep for ep in state.endpoints.endpoints if ep.id in ids]
    return str(balancer.ranking(eps, (7, key))[0].id)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(2, 5),
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 4)), min_size=1, max_size=60),
    st.integers(0, 40),
)
def test_a_joiner_is_planned_the_prompts_whose_home_it_becomes(
    n: int, sends: list[tuple[int, int]], max_requests: int
) -> None:
    ids = [f"e{i}" for i in range(n)]
    state, warmer = fleet(ids, _Pool(), {"max_requests": max_requests})
    for key, at in sends:
        warmer.recent.note(ids[at % n], _Ctx(key, 400))  # type: ignore[arg-type]
    swap(state, [spec(i) for i in ids] + [spec("new")])
    joiner = state.endpoints.by_id["new"]
    jobs = warmer._change_plan([joiner], [])
    assert len(jobs) <= max_requests
    keys = [h.key for _, h in jobs]
    assert len(keys) == len(set(keys))
    for target, h in jobs:
        assert target.id == "new"
        assert first_choice(state, [*ids, "new"], h.key) == "new"
    homed = {k for k, _ in sends if first_choice(state, [*ids, "new"], k) == "new"}
    assert set(keys) <= homed
    # Bounded by the peers' mean recent prefill; where that covers them all, every prompt
    # whose home it became is planned (up to max_requests).
    budget = sum(warmer.recent.recent_prefill(i) for i in ids) / n
    assert sum(h.tokens for _, h in jobs) <= budget
    tokens = {h.key: h.tokens for i in ids for h in warmer.recent.hot(i)}
    if sum(tokens[k] for k in homed) <= budget:
        assert len(keys) == min(max_requests, len(homed))


async def test_a_joiner_is_held_out_until_its_copies_are_answered() -> None:
    pool = _Pool()
    ids = ["a", "b", "c"]
    state, warmer = fleet(ids, pool)
    keys = range(60)
    for key in keys:
        # "a" was sent more (its budget, what this change may spend, covers every move).
        for _ in range(3 if key % 3 == 0 else 1):
            warmer.recent.note(ids[key % 3], _Ctx(key, 400))  # type: ignore[arg-type]
    # A rollout's step: "new" joins as "a" is marked leaving.
    swap(state, [spec("a", leaving=True), spec("b"), spec("c"), spec("new")])
    assert "new" in warmer.excluded
    # Held: the picks see every endpoint but the newcomer; the leaving one still serves.
    tier = list(state.endpoints.endpoints)
    assert [ep.id for ep in warmer.staying(tier)] == ["a", "b", "c"]
    homed = [k for k in keys if first_choice(state, ["b", "c", "new"], k) == "new"]
    assert homed

    await asyncio.wait_for(pool.started.wait(), timeout=10)
    assert set(pool.sent) <= {"http://new:1", "http://b:1", "http://c:1"}
    assert "a" not in warmer.excluded
    pool.gate.set()
    await asyncio.gather(*list(warmer._tasks))
    # Answered: the newcomer takes requests, the leaving one none, and the index names
    # the newcomer as the holder of each prompt warmed there.
    assert warmer.excluded == frozenset({"a"})
    assert [ep.id for ep in warmer.staying(tier)] == ["b", "c", "new"]
    balancer = state.balancer
    assert isinstance(balancer, CacheAware)
    new = state.endpoints.by_id["new"]
    for key in homed:
        assert balancer.matched(new, (7, key)) == 2
    # Each prompt warmed once (one plan for the join and the leave), every one that moves:
    # those whose new home is the newcomer, and the leaving one's to theirs.
    assert pool.sent.count("http://new:1") == len(homed)
    moved = [k for k in keys if k % 3 == 0 and first_choice(state, ["b", "c", "new"], k) != "new"]
    assert len(pool.sent) == len(homed) + len(moved)


async def test_a_held_joiner_is_released_when_the_leaving_endpoint_is_gone() -> None:
    """The control plane drains a leaving endpoint after a bounded warning, warm copies
    answered or not: its prefixes then go to their new homes, the joiner among them,
    not to a third endpoint while the joiner is still held."""
    pool = _Pool()
    ids = ["a", "b", "c"]
    state, warmer = fleet(ids, pool)
    for key in range(60):
        for _ in range(3 if key % 3 == 0 else 1):
            warmer.recent.note(ids[key % 3], _Ctx(key, 400))  # type: ignore[arg-type]
    swap(state, [spec("a", leaving=True), spec("b"), spec("c"), spec("new")])
    await asyncio.wait_for(pool.started.wait(), timeout=10)
    assert "new" in warmer.excluded  # its copies are not answered
    # The warning is over: "a" is drained, no longer published.
    swap(state, [spec("b"), spec("c"), spec("new")])
    assert "new" not in warmer.excluded
    tier = list(state.endpoints.endpoints)
    assert [ep.id for ep in warmer.staying(tier)] == ["b", "c", "new"]
    pool.gate.set()
    await asyncio.gather(*list(warmer._tasks))
    assert warmer.excluded == frozenset()


async def test_a_joiner_with_nothing_to_warm_takes_requests_at_once() -> None:
    pool = _Pool()
    state, warmer = fleet(["a", "b"], pool)
    swap(state, [spec("a"), spec("b"), spec("new")])
    assert warmer.excluded == frozenset()
    assert not warmer._tasks


def test_a_steps_budget_goes_to_the_leaving_endpoints_prompts_first() -> None:
    """A rollout's step with a budget for a few prompts: the leaving endpoint's (they move
    for certain) are planned before those a joiner would only pull."""
    ids = ["a", "b", "c"]
    # Each prompt ~106 tokens; "a" sent 20 of them: a budget of ~0.15 * 2,120, 3 prompts.
    state, warmer = fleet(ids, _Pool(), {"max_prefill_fraction": 0.15})
    for key in range(60):
        # The others' prompts sent more often: used most, yet they do not go first.
        for _ in range(1 if key % 3 == 0 else 3):
            warmer.recent.note(ids[key % 3], _Ctx(key, 400))  # type: ignore[arg-type]
    swap(state, [spec("a", leaving=True), spec("b"), spec("c"), spec("new")])
    staying = ["b", "c", "new"]
    moving_a = list(range(0, 60, 3))
    pulled = [k for k in range(60) if k % 3 and first_choice(state, staying, k) == "new"]
    assert len(moving_a) > 3
    assert pulled
    jobs = warmer._change_plan([state.endpoints.by_id["new"]], [state.endpoints.by_id["a"]])
    assert 1 <= len(jobs) <= 3
    assert all(h.key % 3 == 0 for _, h in jobs), [h.key for _, h in jobs]
