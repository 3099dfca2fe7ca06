"""The cache_aware balancer and prefix blocks: hypothesis properties and examples."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_router.balancers import CacheAware, make_balancer
from llmgw_router.config import CacheAwareConfig
from llmgw_router.prefix import prefix_blocks


@dataclass
class Cand:
    id: str
    weight: int = 1
    outstanding: int = 0
    load: float = 0.0
    generation: int = 0
    up: bool = True


def usable(c: Cand) -> bool:
    return c.up


candidates = st.lists(
    st.builds(
        Cand,
        id=st.text(alphabet="abcdefgh", min_size=1, max_size=4),
        weight=st.integers(1, 4),
        load=st.one_of(st.integers(0, 40).map(float), st.floats(0, 40)),
        up=st.booleans(),
    ),
    min_size=1,
    max_size=8,
    unique_by=lambda c: c.id,
)
prompts = st.binary(min_size=0, max_size=2000)
epsilons = st.sampled_from([0.0, 0.1, 0.25, 1.0])


def bound_holds(picked: Cand, ready: list[Cand], epsilon: float) -> bool:
    """(1 + epsilon) x the mean, with this request, rounded up; else the least loaded."""
    total = sum(c.load for c in ready)
    weight = sum(c.weight for c in ready)
    cap = math.ceil((1 + epsilon) * (total + 1) / weight * picked.weight)
    least = min(c.load / c.weight for c in ready)
    return picked.load + 1 <= cap or picked.load / picked.weight == least


@settings(max_examples=300)
@given(candidates, st.lists(prompts, min_size=1, max_size=6), epsilons, st.integers(0, 2**32))
def test_bounded_load_holds(
    cands: list[Cand], history: list[bytes], epsilon: float, seed: int
) -> None:
    balancer = CacheAware[Cand](epsilon=epsilon, affinity_blocks=2, rng=random.Random(seed))
    ready = [c for c in cands if c.up]
    for prompt in history:
        picked = balancer.pick(cands, usable, None, prefix_blocks(prompt, 64, 64))
        if not ready:
            assert picked is None
            continue
        assert picked is not None
        assert picked.up
        if len(ready) > 1:
            assert bound_holds(picked, ready, epsilon)
        # Load moves as it would: the pick is charged.
        picked.load += 1


@settings(max_examples=200)
@given(candidates, st.lists(prompts, min_size=1, max_size=8), st.randoms())
def test_same_prefix_same_endpoint_on_two_routers(
    cands: list[Cand], sequence: list[bytes], shuffler: random.Random
) -> None:
    """Two balancers that never talk, seeing the same endpoints and loads, agree."""
    a = CacheAware[Cand](rng=random.Random(1))
    b = CacheAware[Cand](rng=random.Random(2))
    for prompt in sequence:
        blocks = prefix_blocks(prompt, 64, 64)
        if not blocks:
            continue
        other = list(cands)
        shuffler.shuffle(other)
        assert a.pick(cands, usable, None, blocks) is b.pick(other, usable, None, blocks)


def test_a_shared_prefix_sticks_and_a_hot_one_spreads() -> None:
    cands = [Cand(f"e{i}") for i in range(4)]
    balancer = CacheAware[Cand](epsilon=0.25, affinity_blocks=4)
    system = b"You are the support assistant of tenant 7. " * 40
    blocks = [prefix_blocks(system + f"question {i}".encode(), 128, 512) for i in range(40)]
    # Idle fleet (each request finishes before the next): one endpoint takes the prefix.
    assert len({balancer.pick(cands, usable, None, b).id for b in blocks}) == 1  # type: ignore[union-attr]
    # All at once (nothing finishes): bounded load spreads the hot prefix over all four,
    # never more than the bound above the mean.
    picks: Counter[str] = Counter()
    for b in blocks:
        picked = balancer.pick(cands, usable, None, b)
        assert picked is not None
        picked.load += 1
        picks[picked.id] += 1
    assert len(picks) == 4
    assert max(c.load for c in cands) <= math.ceil(1.25 * 40 / 4)


def test_different_prefixes_spread_over_the_endpoints() -> None:
    cands = [Cand(f"e{i}") for i in range(4)]
    balancer = CacheAware[Cand]()
    owners = Counter(
        balancer.pick(cands, usable, None, prefix_blocks(f"tenant {t} ".encode() * 50, 128, 512)).id  # type: ignore[union-attr]
        for t in range(400)
    )
    assert len(owners) == 4
    assert all(60 < n < 140 for n in owners.values())


def test_generation_change_clears_that_endpoints_prefix_state() -> None:
    cands = [Cand(f"e{i}") for i in range(3)]
    balancer = CacheAware[Cand](affinity_blocks=1)
    blocks = prefix_blocks(b"x" * 4096, 128, 512)
    picked = balancer.pick(cands, usable, None, blocks)
    assert picked is not None
    assert balancer.matched(picked, blocks) == len(blocks)
    others = [c for c in cands if c is not picked]
    assert all(balancer.matched(c, blocks) == 0 for c in others)
    picked.generation += 1  # the engine restarted: its cache is empty
    assert balancer.matched(picked, blocks) == 0


@given(candidates, prompts, st.integers(1, 5))
def test_generation_change_clears_prefix_state_property(
    cands: list[Cand], prompt: bytes, bumps: int
) -> None:
    balancer = CacheAware[Cand]()
    blocks = prefix_blocks(prompt, 32, 64)
    picked = balancer.pick(cands, usable, None, blocks)
    if picked is None or not blocks:
        return
    assert balancer.matched(picked, blocks) == len(blocks)
    picked.generation += bumps
    assert balancer.matched(picked, blocks) == 0
    # And the endpoints it did not pick never learnt the prefix.
    assert all(balancer.matched(c, blocks) == 0 for c in cands if c is not picked)


def test_what_this_router_sent_refines_the_rendezvous_choice() -> None:
    cands = [Cand(f"e{i}") for i in range(4)]
    balancer = CacheAware[Cand](affinity_blocks=2)
    convo = b'[{"role":"system","content":"' + b"s" * 1000 + b'"}'
    first = balancer.pick(cands, usable, None, prefix_blocks(convo + b"]", 128, 512))
    assert first is not None
    # The same conversation grown by a turn goes where its beginning went, even when
    # another endpoint is as idle.
    longer = convo + b',{"role":"user","content":"' + b"u" * 600 + b'"}]'
    for _ in range(5):
        assert balancer.pick(cands, usable, None, prefix_blocks(longer, 128, 512)) is first


def test_no_prefix_goes_to_the_least_loaded() -> None:
    cands = [Cand("a", load=5), Cand("b", load=1), Cand("c", load=3)]
    balancer = CacheAware[Cand]()
    assert all(balancer.pick(cands, usable, None, ()).id == "b" for _ in range(20))  # type: ignore[union-attr]


def test_make_balancer_takes_the_config() -> None:
    balancer = make_balancer("cache_aware", cache_aware=CacheAwareConfig(epsilon=0.5))
    assert isinstance(balancer, CacheAware)
    assert balancer.epsilon == 0.5


@given(st.binary(max_size=3000), st.binary(max_size=3000), st.sampled_from([16, 64, 128]))
def test_prefix_blocks_are_chained(a: bytes, b: bytes, size: int) -> None:
    """Block i matches exactly when the first i + 1 blocks are equal."""
    ha, hb = prefix_blocks(a, size, 1000), prefix_blocks(b, size, 1000)
    for i in range(min(len(ha), len(hb))):
        if len(a) >= size and len(b) >= size:
            same = a[: (i + 1) * size] == b[: (i + 1) * size]
            if same:
                assert ha[i] == hb[i]
    assert prefix_blocks(a, size, 1000) == ha  # the same in every call and process
    assert len(prefix_blocks(a * 10, size, 3)) <= 3
