"""The step loop and its KV cache, as pure logic: examples and hypothesis properties."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_sim.scheduler import (
    KVCache,
    Scheduler,
    SchedulerConfig,
    Seq,
    StepCosts,
    block_hashes,
)

BS = 4


def _tokens(prefix: int, length: int) -> list[str]:
    """A prompt: ``prefix`` selects a shared head, the rest is unique per call site."""
    return [f"p{prefix}"] * 8 + [f"t{i}" for i in range(length)]


def _seq(rid: int, tokens: list[str], out: int) -> Seq:
    return Seq(rid, len(tokens), out, block_hashes(tokens, BS))


def _run(s: Scheduler, steps: int = 10_000) -> dict[int, list[int]]:
    """Step until idle; per request the step numbers of its sampled tokens."""
    seen: dict[int, list[int]] = {}
    for step in range(steps):
        if s.idle:
            return seen
        plan = s.schedule()
        for ev in s.finish_step(plan):
            if ev.new_tokens:
                seen.setdefault(ev.rid, []).append(step)
    raise AssertionError("scheduler did not drain")


def _check_cache(s: Scheduler) -> None:
    cache = s.cache
    held = [b for seq in s.running for b in seq.blocks]
    assert 0 <= cache.referenced <= cache.num_blocks
    assert cache.available >= 0
    # Every block a running sequence holds is one of the referenced blocks...
    assert len({id(b) for b in held}) <= cache.referenced
    for seq in s.running:
        for b in seq.blocks:
            assert b.ref > 0
            # ...and a cached one is still the block its hash names: never evicted.
            if b.hash is not None:
                assert cache.is_cached(b.hash)
        assert len(seq.blocks) * BS >= seq.computed
    for seq in s.waiting:
        assert not seq.blocks


def test_block_hashes_chain_and_cover_full_blocks_only() -> None:
    a = block_hashes([str(i) for i in range(10)], 4)
    b = block_hashes([str(i) for i in range(8)] + ["x", "y", "z"], 4)
    assert len(a) == 2
    assert a == b
    c = block_hashes(["z"] + [str(i) for i in range(1, 10)], 4)
    assert c[0] != a[0]
    assert c[1] != a[1]


def test_repeated_prefix_hits_and_counts_tokens() -> None:
    s = Scheduler(SchedulerConfig(4, 64, 64, BS))
    tokens = _tokens(0, 13)  # 21 tokens: 5 full blocks
    s.add(_seq(1, tokens, 3))
    _run(s)
    second = _seq(2, tokens, 3)
    s.add(second)
    _run(s)
    # All full blocks but the one holding the last prompt token: (21 - 1) // 4 = 5 blocks.
    assert second.cached_tokens == 20
    assert s.prefix_queries == 42
    assert s.prefix_hits == 20


def test_token_budget_chunks_a_long_prefill() -> None:
    s = Scheduler(SchedulerConfig(4, 16, 64, BS))
    s.add(_seq(1, _tokens(0, 40), 2))  # 48 tokens: three 16-token chunks
    plans = []
    while not s.idle:
        plan = s.schedule()
        plans.append((plan.prefill_tokens, plan.decodes))
        s.finish_step(plan)
    assert plans == [(16, 0), (16, 0), (16, 0), (0, 1)]


def test_max_num_seqs_keeps_the_rest_waiting() -> None:
    s = Scheduler(SchedulerConfig(2, 1000, 256, BS))
    for rid in range(5):
        s.add(_seq(rid, _tokens(rid, 4), 5))
    s.finish_step(s.schedule())
    assert (s.num_running, s.num_waiting) == (2, 3)


def test_lru_evicts_the_oldest_unreferenced_prefix() -> None:
    cache = KVCache(4, BS)
    maybe = [cache.new_block() for _ in range(4)]
    blocks = [b for b in maybe if b is not None]
    assert len(blocks) == 4
    for i, b in enumerate(blocks):
        cache.register(b, 100 + i)
    cache.release(blocks[:2])  # 100, 101 unreferenced (101 released first: tail first)
    cache.release(blocks[2:])
    assert cache.new_block() is not None
    assert not cache.is_cached(101)
    assert cache.is_cached(100)
    assert cache.drain_events() == ([100, 101, 102, 103], [101])


def test_step_time() -> None:
    costs = StepCosts(prefill_tokens_per_s=1000, step_s=0.01, decode_seq_s=0.001)
    assert costs.step_time(0, 0) == 0
    assert abs(costs.step_time(500, 4) - (0.01 + 0.5 + 0.004)) < 1e-9


requests = st.lists(
    # (arrival step, shared prefix, prompt tail length, output tokens, aborted at step or None)
    st.tuples(
        st.integers(0, 30),
        st.integers(0, 3),
        st.integers(0, 40),
        st.integers(1, 12),
        st.none() | st.integers(0, 60),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(requests, st.integers(1, 6), st.integers(4, 64), st.integers(20, 80), st.booleans())
def test_properties_hold_at_every_step(
    reqs: list[tuple[int, int, int, int, int | None]],
    max_seqs: int,
    budget: int,
    blocks: int,
    caching: bool,
) -> None:
    s = Scheduler(SchedulerConfig(max_seqs, budget, blocks, BS, caching))
    want: dict[int, int] = {}
    produced: dict[int, int] = {}
    last_arrival = max(r[0] for r in reqs)
    for step in range(20_000):
        for rid, (arrive, prefix, length, out, abort_at) in enumerate(reqs):
            tokens = _tokens(prefix, length)
            if arrive == step and s.fits(len(tokens), out):
                s.add(_seq(rid, tokens, out))
                want[rid] = out
            if abort_at is not None and arrive + abort_at == step and rid in want:
                s.abort(rid)
                del want[rid]
                produced.pop(rid, None)
        if step > last_arrival and s.idle:
            break
        plan = s.schedule()
        assert sum(i.tokens for i in plan.items) <= budget
        assert len(plan.items) <= max_seqs
        assert s.num_running <= max_seqs
        if plan.empty:
            # Nothing could run although requests are queued would be a deadlock.
            assert s.idle
        _check_cache(s)
        for ev in s.finish_step(plan):
            assert ev.rid in want
            produced[ev.rid] = produced.get(ev.rid, 0) + ev.new_tokens
        _check_cache(s)
    assert s.idle
    # Every request that was not aborted produced exactly what it asked for.
    assert {r: produced.get(r, 0) for r in want} == want
    # With everything finished no block is referenced; cached ones stay within the cache.
    assert s.cache.referenced == 0
    assert s.cache.cached_blocks <= blocks


def test_a_transferred_prompt_costs_one_prefill_token_and_holds_its_blocks() -> None:
    """Issue 32: a decode of a prefill engine's KV cache computes only the last prompt
    token (the prefill was charged to the prefill engine), yet holds the whole prompt's
    blocks; a local prefill of the same prompt costs every token."""
    s = Scheduler(SchedulerConfig(4, 16, 64, BS))
    tokens = _tokens(0, 40)  # 48 tokens
    s.add(Seq(1, len(tokens), 2, block_hashes(tokens, BS), remote_kv=True))
    plans = []
    while not s.idle:
        plan = s.schedule()
        plans.append((plan.prefill_tokens, plan.decodes))
        if len(plans) == 1:
            (item,) = plan.items
            assert len(item.seq.blocks) * BS >= len(tokens)
        s.finish_step(plan)
    assert plans == [(1, 0), (0, 1)]
    assert s.prefix_hits == 0  # a transfer is not a prefix-cache hit
