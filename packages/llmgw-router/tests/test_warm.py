"""Warming before a drain (proxy/warm.py, issue 28 point 3): the plan (pure) and the sample."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st
from llmgw_router.proxy.warm import Hot, RecentPrompts, plan, warm_body

ENDPOINTS = ["a", "b", "c", "d"]


def hot_list(draw: st.DrawFn) -> list[Hot]:
    n = draw(st.integers(0, 30))
    return [
        Hot(
            key=i,
            model="m",
            path="/v1/completions",
            body=b"{}",
            prefix=(i,),
            tokens=draw(st.integers(1, 5000)),
            uses=draw(st.integers(1, 50)),
        )
        for i in range(n)
    ]


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[Hot], frozenset[str], dict[int, str | None], int, int]:
    hot = hot_list(draw)
    leaving = frozenset(draw(st.sets(st.sampled_from(ENDPOINTS), min_size=1, max_size=3)))
    homes = {h.key: draw(st.none() | st.sampled_from(ENDPOINTS)) for h in hot}
    return hot, leaving, homes, draw(st.integers(0, 40)), draw(st.integers(0, 60_000))


@given(cases())
def test_plan_is_bounded_and_never_sends_to_a_leaving_endpoint(
    case: tuple[list[Hot], frozenset[str], dict[int, str | None], int, int],
) -> None:
    hot, leaving, homes, max_requests, max_tokens = case
    jobs = plan(
        hot, leaving, lambda h: homes[h.key], max_requests=max_requests, max_tokens=max_tokens
    )
    assert len(jobs) <= max_requests
    assert sum(h.tokens for _, h in jobs) <= max_tokens
    for target, h in jobs:
        assert target not in leaving
        assert target == homes[h.key]
    assert len({h.key for _, h in jobs}) == len(jobs)
    # The most used first: a prompt left out that fitted and had a home was used no more
    # than every one planned (or the count was reached).
    planned = {h.key for _, h in jobs}
    spent = sum(h.tokens for _, h in jobs)
    if len(jobs) < max_requests:
        for h in hot:
            home = homes[h.key]
            if h.key in planned or home is None or home in leaving:
                continue
            assert spent + h.tokens > max_tokens


def test_plan_examples() -> None:
    hot = [
        Hot(1, "m", "/v1/completions", b"{}", (1,), tokens=100, uses=1),
        Hot(2, "m", "/v1/completions", b"{}", (2,), tokens=100, uses=9),
        Hot(3, "m", "/v1/completions", b"{}", (3,), tokens=100, uses=5),
    ]
    homes = {1: "b", 2: "c", 3: "a"}
    jobs = plan(hot, frozenset({"a"}), lambda h: homes[h.key], max_requests=5, max_tokens=1000)
    assert [(t, h.key) for t, h in jobs] == [("c", 2), ("b", 1)]
    jobs = plan(hot, frozenset({"x"}), lambda h: homes[h.key], max_requests=2, max_tokens=1000)
    assert [h.key for _, h in jobs] == [2, 3]
    jobs = plan(hot, frozenset({"x"}), lambda h: homes[h.key], max_requests=5, max_tokens=150)
    assert [h.key for _, h in jobs] == [2]


def test_warm_body_asks_for_one_token_and_keeps_the_prompt() -> None:
    body = msgspec.json.encode(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_completion_tokens": 500,
            "n": 3,
            "temperature": 0.5,
        }
    )
    out = msgspec.json.decode(warm_body(body) or b"")
    assert out == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": False,
        "max_tokens": 1,
        "temperature": 0.5,
    }
    assert warm_body(b"[1]") is None
    assert warm_body(b"{nope") is None


class _Ctx:
    def __init__(self, prefix: tuple[int, ...], body: bytes) -> None:
        self.prefix = prefix
        self.body = body
        self.model = "m"
        self.path = "/v1/completions"


@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 20), st.integers(4, 4000)),
        max_size=200,
    ),
    st.integers(1, 8),
    st.integers(1, 16),
)
def test_recent_prompts_are_bounded(
    sends: list[tuple[str, int, int]], per_endpoint: int, window: int
) -> None:
    recent = RecentPrompts(per_endpoint, window, affinity_blocks=2)
    log: dict[str, list[tuple[int, int]]] = {"a": [], "b": []}
    for ep, key, size in sends:
        recent.note(ep, _Ctx((99, key, 7), b"x" * size))  # type: ignore[arg-type]
        log[ep].append((key, size // 4))
    for ep in ("a", "b"):
        hot = recent.hot(ep)
        assert len(hot) <= per_endpoint
        assert len({h.key for h in hot}) == len(hot)
        assert recent.recent_prefill(ep) == sum(t for _, t in log[ep][-window:])
        # The keys kept are the most recently sent ones.
        order = list(dict.fromkeys(reversed([k for k, _ in log[ep]])))
        assert {h.key for h in hot} == set(order[:per_endpoint])
