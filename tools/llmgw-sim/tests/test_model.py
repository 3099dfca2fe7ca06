"""The pure timing model: prefix cache, batch slots, token pace, output length."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_sim.model import (
    BatchSlots,
    PrefixCache,
    Timing,
    echo_tokens,
    generate_tokens,
    greedy_tokens,
    output_length,
    tokenize,
)


def test_tokenize_counts_words_and_punctuation() -> None:
    assert tokenize("Hello, world!") == ["Hello", ",", " world", "!"]
    assert "".join(tokenize("a  b\nc")) == "a  b\nc"


def test_generated_tokens_are_deterministic() -> None:
    assert generate_tokens(5, 3) == generate_tokens(5, 3)
    assert len(generate_tokens(100, 0)) == 100
    assert echo_tokens(["a", "b"], 5) == ["a", "b", "a", "b", "a"]


def test_prefix_cache_hits_a_shared_prefix() -> None:
    cache = PrefixCache(block_size=4, capacity_blocks=100)
    prompt = [str(i) for i in range(20)]
    hit, hashes = cache.lookup(prompt)
    assert hit == 0
    cache.insert(hashes)
    hit, _ = cache.lookup(prompt[:12] + ["x"] * 8)
    assert hit == 12
    # A fully cached prompt still recomputes its last token: 19 usable -> 4 blocks.
    hit, _ = cache.lookup(prompt)
    assert hit == 16
    assert (cache.queries, cache.hits) == (60, 28)


def test_prefix_cache_evicts_least_recently_used() -> None:
    cache = PrefixCache(block_size=2, capacity_blocks=2)
    a, b = ["a"] * 5, ["b"] * 5
    cache.insert(cache.lookup(a)[1])
    cache.insert(cache.lookup(b)[1])
    assert len(cache) == 2
    assert cache.lookup(a)[0] == 0
    assert cache.lookup(b)[0] == 4


def test_disabled_prefix_cache_never_hits() -> None:
    cache = PrefixCache(block_size=2, capacity_blocks=10, enabled=False)
    cache.insert(cache.lookup(["a"] * 9)[1])
    assert cache.lookup(["a"] * 9)[0] == 0


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 8),
    st.integers(0, 20),
    st.lists(st.lists(st.sampled_from("abc"), max_size=40), max_size=30),
)
def test_prefix_cache_never_reports_more_hits_than_queries(
    block: int, capacity: int, prompts: list[list[str]]
) -> None:
    cache = PrefixCache(block, capacity)
    for prompt in prompts:
        hit, hashes = cache.lookup(prompt)
        assert 0 <= hit < max(1, len(prompt))
        assert hit % block == 0
        cache.insert(hashes)
        assert len(cache) <= capacity
    assert cache.hits <= cache.queries


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.lists(st.tuples(st.booleans(), st.integers(0, 30)), max_size=80))
def test_batch_slots_never_run_more_than_max(max_running: int, ops: list[tuple[bool, int]]) -> None:
    slots = BatchSlots(max_running)
    live: list[int] = []
    next_id = 0
    for add, pick in ops:
        if add or not live:
            next_id += 1
            slots.submit(next_id)
            live.append(next_id)
        else:
            rid = live.pop(pick % len(live))
            started = slots.release(rid)
            assert all(slots.is_running(s) for s in started)
        assert slots.running <= max_running
        assert slots.running + slots.waiting == len(live)
        # Work conservation: nobody waits while a slot is free.
        assert slots.waiting == 0 or slots.running == max_running


def test_batch_slots_first_come_first_served() -> None:
    slots = BatchSlots(1)
    assert slots.submit(1) is True
    assert slots.submit(2) is False
    assert slots.submit(3) is False
    slots.release(2)  # abandoned while waiting
    assert slots.release(1) == [3]
    with pytest.raises(ValueError, match="twice"):
        slots.submit(3)


def test_timing_prefill_shrinks_with_cached_prefix() -> None:
    t = Timing(ttft=0.1, itl=0.01, prefill_per_token=0.001)
    assert t.time_to_first_token(100, 0) == pytest.approx(0.2)
    assert t.time_to_first_token(100, 96) == pytest.approx(0.104)
    assert t.decode_time(11) == pytest.approx(0.1)


def test_load_scale_stretches_times_as_slots_fill() -> None:
    t = Timing(load_factor=3.0)
    assert t.load_scale(1, 5) == 1.0
    assert t.load_scale(3, 5) == pytest.approx(2.0)
    assert t.load_scale(5, 5) == pytest.approx(3.0)
    assert t.load_scale(1, 1) == 3.0
    assert Timing().load_scale(5, 5) == 1.0


@settings(max_examples=100, deadline=None)
@given(st.floats(0.0, 10.0), st.floats(0.0, 10.0), st.integers(0, 2**32))
def test_jitter_stays_within_bounds(mean: float, std: float, seed: int) -> None:
    value = Timing.jitter(mean, std, random.Random(seed))
    assert 0.3 * mean - 1e-12 <= value <= 1.7 * mean + 1e-12


@pytest.mark.parametrize(
    ("requested", "sim_len", "prompt", "ctx", "expected"),
    [
        (10, None, 5, 100, (10, "length")),
        (None, None, 5, 100, (16, "stop")),
        (10, 4, 5, 100, (4, "stop")),
        (None, 1000, 5, 100, (95, "length")),
        (None, None, 90, 100, (10, "length")),
        (4000, None, 98, 100, (2, "length")),
        (4000, 3, 10, 100, (3, "stop")),
    ],
)
def test_output_length(
    requested: int | None, sim_len: int | None, prompt: int, ctx: int, expected: tuple[int, str]
) -> None:
    assert (
        output_length(
            requested_max=requested,
            sim_output_len=sim_len,
            default_max_tokens=16,
            prompt_tokens=prompt,
            max_model_len=ctx,
        )
        == expected
    )


@settings(max_examples=200, deadline=None)
@given(
    context=st.text(max_size=200),
    count=st.integers(0, 60),
    cut=st.integers(0, 60),
    seed=st.integers(-(1 << 40), 1 << 40),
)
def test_greedy_text_continues_from_any_prefix_of_itself(
    context: str, count: int, cut: int, seed: int
) -> None:
    """As a greedy model's: the prompt followed by the first k tokens gives the rest."""
    out = greedy_tokens(context, count, seed)
    assert len(out) == count
    assert greedy_tokens(context, count, seed) == out
    k = min(cut, count)
    assert greedy_tokens(context + "".join(out[:k]), count - k, seed) == out[k:]


def test_greedy_text_depends_on_the_prompt_and_the_seed() -> None:
    assert greedy_tokens("Hello there", 12) != greedy_tokens("Hello where", 12)
    assert greedy_tokens("Hello there", 12, 1) != greedy_tokens("Hello there", 12, 2)
    # Words, each with its leading space, not one repeated token.
    assert len(set(greedy_tokens("x", 50))) > 10
