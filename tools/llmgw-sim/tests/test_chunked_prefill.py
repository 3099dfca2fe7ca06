"""The step scheduler's chunked prefill against vLLM's (issue 32): what a decoding stream
pays while a long prompt is prefilled beside it.

vLLM's scheduler (vllm/v1/core/sched/scheduler.py, ``Scheduler.schedule``) gives each
step one ``token_budget`` (``--max-num-batched-tokens``): running requests first (a
decode takes one token, a partial prefill ``min(remaining, budget)``), then waiting ones
with what is left, so a new prompt's chunk is the budget less the running decodes, and
every step until its prefill is done carries both. The forward pass's time grows with the
tokens in it, so each of those steps is slower for every decoding stream: one stall of
``budget / prefill rate`` per chunk, not one per prompt.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_sim.scheduler import Scheduler, SchedulerConfig, Seq, StepCosts, block_hashes

BS = 16


def _seq(rid: int, length: int, out: int) -> Seq:
    tokens = [f"r{rid}t{i}" for i in range(length)]
    return Seq(rid, length, out, block_hashes(tokens, BS))


def _decoding(s: Scheduler, n: int) -> None:
    """``n`` short requests admitted and past their prefill: decoding."""
    for rid in range(n):
        s.add(_seq(rid, 4, 10_000))
    while any(seq.prefilling for seq in s.running) or s.waiting:
        s.finish_step(s.schedule())


def _plans_until_prefilled(s: Scheduler, long: Seq) -> list[tuple[int, int]]:
    out = []
    while long.prefilling or not long.admitted:
        plan = s.schedule()
        out.append((plan.prefill_tokens, plan.decodes))
        s.finish_step(plan)
    return out


def test_every_step_of_a_long_prefill_carries_the_decodes_and_is_slower() -> None:
    s = Scheduler(SchedulerConfig(64, 512, 4096, BS))
    _decoding(s, 3)
    long = _seq(100, 2000, 4)
    s.add(long)
    plans = _plans_until_prefilled(s, long)
    # 2000 tokens in chunks of 512 - 3: 509, 509, 509, 473; the three streams decode in each.
    assert plans == [(509, 3), (509, 3), (509, 3), (473, 3)]
    costs = StepCosts(prefill_tokens_per_s=10_000, step_s=0.016, decode_seq_s=0.0002)
    alone = costs.step_time(0, 3)
    assert all(costs.step_time(p, d) > alone for p, d in plans)
    # The stall a stream sees per chunk is the chunk's prefill time.
    assert abs(costs.step_time(509, 3) - alone - 509 / 10_000) < 1e-9


@settings(deadline=None)
@given(
    budget=st.integers(16, 4096),
    decodes=st.integers(0, 7),
    prompt=st.integers(1, 8192),
)
def test_chunks_are_the_budget_less_the_decodes(budget: int, decodes: int, prompt: int) -> None:
    s = Scheduler(SchedulerConfig(64, budget, 1 << 16, BS))
    _decoding(s, decodes)
    long = _seq(100, prompt, 1)
    s.add(long)
    plans = _plans_until_prefilled(s, long)
    assert sum(p for p, _ in plans) == prompt
    assert all(d == decodes for _, d in plans)
    assert all(p == budget - decodes for p, _ in plans[:-1])
    assert 0 < plans[-1][0] <= budget - decodes


@given(
    tokens=st.integers(0, 100_000),
    more=st.integers(1, 10_000),
    decodes=st.integers(0, 256),
)
def test_a_step_is_slower_the_more_prefill_it_carries(tokens: int, more: int, decodes: int) -> None:
    costs = StepCosts()
    assert costs.step_time(tokens + more, decodes) > costs.step_time(tokens, decodes)
