"""An endpoint keeps its own figures (issue 25 point 3): the request path only tells it
when an attempt began, when its first byte came and when it ended; the clock is passed
in. Pure, no I/O."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st
from llmgw_router.endpoints import CacheChange, Endpoint, EndpointSpec, EngineLoad


def make() -> Endpoint:
    return Endpoint(spec=EndpointSpec(id="e1", url="http://127.0.0.1:1", models=("m",)))


def test_an_attempt_is_outstanding_and_awaiting_until_its_first_byte() -> None:
    ep = make()
    work = ep.attempt(10)
    assert (ep.outstanding, ep.awaiting_first, ep.pending_blocks) == (1, 1, 10.0)
    ep.first_byte(10, work, 0.5)
    assert (ep.outstanding, ep.awaiting_first, ep.pending_blocks) == (1, 0, 0.0)
    # 10 blocks in 0.5 s: the first measurement is taken as it is.
    assert ep.learned_block_time == 0.05
    ep.attempt_ended(10, work, True, 1.0)
    assert (ep.outstanding, ep.awaiting_first) == (0, 0)


def test_an_attempt_that_fails_before_its_first_byte_teaches_no_block_time() -> None:
    ep = make()
    work = ep.attempt(10)
    ep.attempt_ended(10, work, False, 1.0)
    assert (ep.outstanding, ep.awaiting_first, ep.pending_blocks) == (0, 0, 0.0)
    assert ep.learned_block_time == 0.0


def test_the_load_is_read_on_the_clock_it_is_given() -> None:
    ep = make()
    ep.report(EngineLoad(running=3, waiting=1, measured_at=100.0))
    assert ep.load_at(100.5) == 4.0
    # Past load_reports.max_age (2 s by default) the figures are stale: own count only.
    ep.attempt(0)
    assert ep.load_at(103.0) == 1.0
    assert ep.pending_at(103.0) == 0.0


@given(
    st.lists(st.tuples(st.integers(0, 50), st.booleans(), st.floats(0.0, 5.0)), max_size=40),
    st.randoms(use_true_random=False),
)
def test_every_attempt_that_ends_leaves_no_figure_behind(
    attempts: list[tuple[int, bool, float]], rnd: random.Random
) -> None:
    """Whatever the order in which attempts begin, answer and end, once all have ended
    nothing is outstanding, awaiting or pending, and the counts never go negative."""
    ep = make()
    ep.report(EngineLoad(measured_at=0.0))
    live: list[tuple[int, float, bool, float]] = []
    for miss, answered, seconds in attempts:
        live.append((miss, ep.attempt(miss), answered, seconds))
    assert ep.outstanding == ep.awaiting_first == len(attempts)
    rnd.shuffle(live)
    for at, (miss, work, answered, seconds) in enumerate(live):
        if answered:
            ep.first_byte(miss, work, seconds)
        ep.attempt_ended(miss, work, answered, float(at))
        assert min(ep.outstanding, ep.awaiting_first) >= 0
        assert ep.pending_blocks >= 0
    assert (ep.outstanding, ep.awaiting_first) == (0, 0)
    assert ep.pending_blocks < 1e-6
    assert ep.finished_since_report == len(attempts)


@given(
    st.lists(
        st.tuples(
            st.booleans(),
            st.lists(st.integers(0, 20), max_size=8),
            st.lists(st.integers(0, 20), max_size=8),
            st.booleans(),
        ),
        max_size=30,
    )
)
def test_cache_changes_keep_a_count_that_is_never_negative(
    changes: list[tuple[bool, list[int], list[int], bool]],
) -> None:
    """The endpoint applies its engine's cache changes itself (the watcher only translates
    the wire): whatever comes, the block count stays at zero or above, and blocks named by
    the engine's own hashes end the token-id view."""
    ep = make()
    for cleared, stored, removed, by_token_ids in changes:
        ep.cache_changed(
            CacheChange(
                cleared=cleared,
                stored=stored,
                removed=removed,
                by_token_ids=by_token_ids,
                block_size=16,
            )
        )
        assert ep.cached_blocks >= 0
        if stored and not by_token_ids:
            assert ep.token_blocks is None
        if ep.token_blocks is not None:
            assert set(stored) <= ep.token_blocks


def test_each_router_state_gives_its_own_endpoints_its_settings() -> None:
    """A router state configures its endpoints, never the Endpoint class: two in one
    process (or a test after another) keep their own max age and prefix block."""
    from llmgw_proto.config import convert
    from llmgw_router.config import RouterConfig
    from llmgw_router.endpoints import EndpointSet
    from llmgw_router.metrics import Metrics
    from llmgw_router.state import RouterState

    def state(max_age: str, block_bytes: int) -> RouterState:
        cfg = convert(
            {
                "load_reports": {"max_age": max_age},
                "cache_aware": {"block_bytes": block_bytes},
                "health_checks": {"enabled": False},
            },
            RouterConfig,
            source="test",
        )
        return RouterState(cfg, EndpointSet([make()]), Metrics())

    a = state("1s", 256)
    b = state("5s", 1024)
    ep_a, ep_b = a.endpoints.endpoints[0], b.endpoints.endpoints[0]
    assert (ep_a.max_age, ep_b.max_age) == (1.0, 5.0)
    assert ep_a.block_tokens < ep_b.block_tokens
    # The class keeps its defaults; a swapped-in set gets the state's settings too.
    assert (Endpoint.load_max_age, Endpoint.tokens_per_block) == (2.0, 64.0)
    fresh = EndpointSet([make()])
    a.swap(fresh)
    assert fresh.endpoints[0].max_age == 1.0
    ep_a.report(EngineLoad(running=7, measured_at=100.0))
    # 1.5 s after the reading: stale for a (1 s), fresh for b (5 s).
    assert ep_a.load_at(101.5) == float(ep_a.outstanding)
    ep_b.report(EngineLoad(running=7, measured_at=100.0))
    assert ep_b.load_at(101.5) == 7.0
