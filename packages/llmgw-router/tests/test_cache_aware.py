"""The cache_aware balancer and prefix blocks: hypothesis properties and examples."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from typing import Any

from hypothesis import assume, given, settings
from hypothesis import strategies as st
from llmgw_router.balancing import CacheAware, make_balancer
from llmgw_router.balancing.prefix import prefix_blocks, prompt_text
from llmgw_router.config import CacheAwareConfig
from llmgw_testkit.candidates import Cand, usable

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


slacks = st.sampled_from([0.0, 1.0, 3.0])


def bound_holds(picked: Cand, ready: list[Cand], epsilon: float, slack: float) -> bool:
    """ceil((1 + epsilon) x its share, with this request) + slack; else the least loaded."""
    total = sum(c.load for c in ready)
    weight = sum(c.weight for c in ready)
    cap = math.ceil((1 + epsilon) * (total + 1) / weight * picked.weight) + (
        slack * picked.weight * len(ready) / weight
    )
    least = min(c.load / c.weight for c in ready)
    # The bound counts requests: a load's fraction (KV-cache use) never tips it over.
    return math.floor(picked.load) + 1 <= cap or picked.load / picked.weight == least


@settings(max_examples=300)
@given(
    candidates,
    st.lists(prompts, min_size=1, max_size=6),
    epsilons,
    slacks,
    st.integers(1, 8),
    st.integers(0, 2**32),
)
def test_bounded_load_holds(
    cands: list[Cand], history: list[bytes], epsilon: float, slack: float, window: int, seed: int
) -> None:
    balancer = CacheAware[Cand](
        epsilon=epsilon, slack=slack, window=window, affinity_blocks=2, rng=random.Random(seed)
    )
    ready = [c for c in cands if c.up]
    for prompt in history:
        picked = balancer.pick(cands, usable, None, prefix_blocks(prompt, 64, 64), at=0.0)
        if not ready:
            assert picked is None
            continue
        assert picked is not None
        assert picked.up
        if len(ready) > 1:
            assert bound_holds(picked, ready, epsilon, slack)
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
        assert a.pick(cands, usable, None, blocks, at=0.0) is b.pick(
            other, usable, None, blocks, at=0.0
        )


def test_a_shared_prefix_sticks_and_a_hot_one_spreads() -> None:
    cands = [Cand(f"e{i}") for i in range(4)]
    balancer = CacheAware[Cand](epsilon=0.25, slack=0.0, affinity_blocks=4)
    system = b"You are the support assistant of tenant 7. " * 40
    blocks = [prefix_blocks(system + f"question {i}".encode(), 128, 512) for i in range(40)]
    # Idle fleet (each request finishes before the next), the prefix one of many: one
    # endpoint takes it.
    homes: set[str] = set()
    for i, b in enumerate(blocks):
        for t in range(8):
            other = f"tenant {t} of many, question {i}. ".encode() * 40
            balancer.pick(cands, usable, None, prefix_blocks(other, 128, 512), at=0.0)
        homes.add(balancer.pick(cands, usable, None, b, at=0.0).id)  # type: ignore[union-attr]
    assert len(homes) == 1
    # All at once (nothing finishes): bounded load spreads the hot prefix over all four,
    # never more than the bound above the mean.
    picks: Counter[str] = Counter()
    for b in blocks:
        picked = balancer.pick(cands, usable, None, b, at=0.0)
        assert picked is not None
        picked.load += 1
        picks[picked.id] += 1
    assert len(picks) == 4
    assert max(c.load for c in cands) <= math.ceil(1.25 * 40 / 4)


def test_small_counts_keep_affinity_within_the_slack() -> None:
    """Tenants at 1-3 requests in flight per engine: one more is within the slack."""
    cands = [Cand(f"e{i}") for i in range(4)]
    balancer = CacheAware[Cand](epsilon=0.25, slack=3.0, affinity_blocks=4)
    tenants = [f"You are the assistant of tenant {t}. ".encode() * 40 for t in range(32)]
    home = {
        t: balancer.pick(cands, usable, None, prefix_blocks(p, 128, 512), at=0.0)
        for t, p in enumerate(tenants)
    }
    rng = random.Random(7)
    for i in range(400):
        for c in cands:
            c.load = float(rng.randint(0, 2))
        t = rng.randrange(32)
        picked = balancer.pick(
            cands, usable, None, prefix_blocks(tenants[t] + b"%d" % i, 128, 512), at=0.0
        )
        assert picked is home[t]


def test_hot_prefix_spreads_evenly_while_nothing_queues() -> None:
    """Every request one prefix, each finishing before the next: the demand (its share of
    the recent picks) spreads it over every endpoint, evenly."""
    cands = [Cand(f"e{i}") for i in range(4)]
    balancer = CacheAware[Cand](epsilon=0.25, slack=3.0, affinity_blocks=4)
    system = b"One system prompt for all. " * 60
    picks = Counter(
        balancer.pick(cands, usable, None, prefix_blocks(system + b"%d" % i, 128, 512), at=0.0).id  # type: ignore[union-attr]
        for i in range(400)
    )
    assert len(picks) == 4
    assert max(picks.values()) <= 1.25 * 100


def test_an_over_bound_spill_goes_to_the_next_in_rendezvous_order_then_stays_there() -> None:
    cands = [Cand(f"e{i}") for i in range(4)]
    balancer = CacheAware[Cand](epsilon=0.25, slack=1.0, affinity_blocks=4)
    prompt = b"tenant prefix " * 80
    blocks = prefix_blocks(prompt, 128, 512)
    home = balancer.pick(cands, usable, None, blocks, at=0.0)
    assert home is not None
    order = [c for c in balancer.ranking(cands, blocks) if c is not home]
    home.load = 10.0
    # The next in rendezvous order is within the bound though not the least loaded: it
    # takes the spill, so every router sends this prefix's overflow to one second home.
    for load, c in zip((2.0, 1.0, 0.0), order, strict=True):
        c.load = load
    spill = balancer.pick(cands, usable, None, prefix_blocks(prompt + b"x", 128, 512), at=0.0)
    assert spill is order[0]
    # While the home stays over the bound, the prefix goes to that holder within it (a
    # cache hit), even when others are less loaded now.
    order[0].load = 3.0
    again = balancer.pick(cands, usable, None, prefix_blocks(prompt + b"y", 128, 512), at=0.0)
    assert again is order[0]
    # The holder over the bound too: the next in order within it.
    order[0].load = 10.0
    third = balancer.pick(cands, usable, None, prefix_blocks(prompt + b"w", 128, 512), at=0.0)
    assert third is order[1]
    # Back within the bound: home again.
    home.load = 1.0
    assert (
        balancer.pick(cands, usable, None, prefix_blocks(prompt + b"z", 128, 512), at=0.0) is home
    )


@given(st.lists(st.integers(0, 4).map(float), min_size=4, max_size=4))
def test_a_new_prefix_goes_to_its_first_rendezvous_choice_within_the_bound(
    loads: list[float],
) -> None:
    """Routers share the engines' figures but each adds only its own sends since: a
    first placement that looked at loads had four routers cache a tenant on two engines.
    Whatever the loads, while it stays within the bound, every router places it alike."""
    prompt = b"a tenant never seen before " * 40
    blocks = prefix_blocks(prompt, 128, 512)
    cands = [Cand(f"e{i}") for i in range(4)]
    first, *_ = CacheAware[Cand]().ranking(cands, blocks)
    for c, load in zip(cands, loads, strict=True):
        c.load = load
    balancer = CacheAware[Cand]()
    picked = balancer.pick(cands, usable, None, blocks, at=0.0)
    total = sum(loads)
    if balancer.within(first.load, total, 1, 4, 4):
        assert picked is first
    else:
        assert picked is not first


def test_routers_that_placed_a_prefix_apart_converge_on_its_first_choice() -> None:
    """Router a saw the prefix's first choice over the bound and placed it on the second;
    router b placed it on the first. Once the first is no more loaded than a's holder, a goes
    there too (and stays), so the prefix ends up cached in one place."""
    prompt = b"a tenant's long system prompt " * 200  # 23 blocks, past affinity_blocks
    cands = [Cand(f"e{i}") for i in range(4)]
    a, b = CacheAware[Cand](), CacheAware[Cand]()
    home, second, *_ = a.ranking(cands, prefix_blocks(prompt, 256, 512))
    home.load = 9.0  # over the bound: the prefix spills to its second choice
    assert a.pick(cands, usable, None, prefix_blocks(prompt + b"1", 256, 512), at=0.0) is second
    home.load = 0.0
    assert b.pick(cands, usable, None, prefix_blocks(prompt + b"2", 256, 512), at=0.0) is home
    # Still busier than a's holder: a stays where it has the prefix cached.
    home.load, second.load = 1.0, 0.0
    assert a.pick(cands, usable, None, prefix_blocks(prompt + b"3", 256, 512), at=0.0) is second
    # No busier: home, and from then on home while it is within the bound.
    home.load = 0.0
    assert a.pick(cands, usable, None, prefix_blocks(prompt + b"4", 256, 512), at=0.0) is home
    home.load = 1.0
    assert a.pick(cands, usable, None, prefix_blocks(prompt + b"5", 256, 512), at=0.0) is home


def test_where_prompts_share_nothing_a_new_one_goes_to_the_least_loaded() -> None:
    """Most recent picks distinct: the least loaded of all (nothing will recur), ties in
    rendezvous order."""
    cands = [Cand(f"e{i}") for i in range(4)]
    balancer = CacheAware[Cand](window=64)
    for i in range(64):
        balancer.pick(cands, usable, None, prefix_blocks(b"unique %d " % i * 60, 128, 512), at=0.0)
    blocks = prefix_blocks(b"one more unique prompt " * 40, 128, 512)
    first, second, third, fourth = balancer.ranking(cands, blocks)
    first.load, second.load, third.load, fourth.load = 1.0, 0.5, 2.0, 0.25
    assert balancer.pick(cands, usable, None, blocks, at=0.0) is fourth
    blocks = prefix_blocks(b"and another unique prompt " * 40, 128, 512)
    first, second, third, fourth = balancer.ranking(cands, blocks)
    first.load, second.load, third.load, fourth.load = 1.0, 0.0, 2.0, 0.0
    assert balancer.pick(cands, usable, None, blocks, at=0.0) is second


@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 6).map(float)), min_size=2, max_size=8),
    st.binary(min_size=200),
)
def test_a_prompt_that_shares_nothing_goes_where_the_fewest_wait_for_a_first_token(
    queues: list[tuple[int, float]], tail: bytes
) -> None:
    """The fewest requests still without a first byte (queued or in prefill), then the
    least loaded."""
    cands = [Cand(f"e{i}") for i in range(len(queues))]
    balancer = CacheAware[Cand](window=16)
    for i in range(16):
        balancer.pick(cands, usable, None, prefix_blocks(b"warm %d " % i * 60, 128, 512), at=0.0)
    for c, (waiting, load) in zip(cands, queues, strict=True):
        c.awaiting_first, c.load = waiting, max(load, float(waiting))
    fewest = min(cands, key=lambda c: (c.awaiting_first, c.load))
    total = sum(c.load for c in cands)
    # Where that one is over the bound, the bound decides (its own tests): not this rule.
    assume(balancer.within(fewest.load, total, 1, len(cands), len(cands)))
    picked = balancer.pick(cands, usable, None, prefix_blocks(tail + b"!" * 300, 128, 512), at=0.0)
    assert picked is not None
    assert (picked.awaiting_first, picked.load) == min((c.awaiting_first, c.load) for c in cands)


def test_kv_cache_use_does_not_tip_an_endpoint_over_the_bound() -> None:
    """5 requests and a quarter of the KV cache, the mean under 2, slack 3: within
    ceil(1.25 x 8.5 / 4) + 3 = 6 with this one, so the prefix stays (a cache hit)."""
    cands = [Cand(f"e{i}") for i in range(4)]
    balancer = CacheAware[Cand](epsilon=0.25, slack=3.0, affinity_blocks=4)
    prompt = b"tenant prefix " * 80
    home = balancer.pick(cands, usable, None, prefix_blocks(prompt, 128, 512), at=0.0)
    assert home is not None
    home.load = 5.25
    for c, load in zip((c for c in cands if c is not home), (1.0, 1.0, 0.25), strict=True):
        c.load = load
    assert (
        balancer.pick(cands, usable, None, prefix_blocks(prompt + b"x", 128, 512), at=0.0) is home
    )
    # One request more is over it: the prefix spills.
    home.load = 6.25
    assert (
        balancer.pick(cands, usable, None, prefix_blocks(prompt + b"y", 128, 512), at=0.0)
        is not home
    )


def test_different_prefixes_spread_over_the_endpoints() -> None:
    cands = [Cand(f"e{i}") for i in range(4)]
    balancer = CacheAware[Cand]()
    owners = Counter(
        balancer.pick(
            cands, usable, None, prefix_blocks(f"tenant {t} ".encode() * 50, 128, 512), at=0.0
        ).id  # type: ignore[union-attr]
        for t in range(400)
    )
    assert len(owners) == 4
    assert all(60 < n < 140 for n in owners.values())


def test_one_router_gives_each_endpoint_its_share_of_the_tenants() -> None:
    """Where every prefix fits, 32 tenants over 4 endpoints are 8 on each (rendezvous alone
    gave 11, 9, 6 and 6: the engine with 11 queued), and each stays where it was placed;
    an endpoint that joins takes tenants that rank it above their home, up to its share,
    ranking() naming the new home first (what warming reads); a tenant moves only up its
    rendezvous order, and the counts end within the shares."""
    cands = [Cand(f"e{i}") for i in range(4)]
    balancer = CacheAware[Cand]()

    def prompt(t: int, turn: int) -> tuple[int, ...]:
        return prefix_blocks(f"tenant {t} system ".encode() * 100 + b"%d" % turn, 128, 512)

    served: dict[int, str] = {}
    reasons: Counter[str] = Counter()
    for turn in range(3):
        for t in range(32):
            pick = balancer.choose(cands, usable, None, prompt(t, turn), at=0.0)
            assert pick.endpoint is not None
            assert served.setdefault(t, pick.endpoint.id) == pick.endpoint.id
            reasons[pick.reason] += 1
    assert sorted(Counter(served.values()).values()) == [8, 8, 8, 8]
    assert reasons["balance"] > 0  # rendezvous alone would not have given 8 each
    assert reasons["rendezvous"] + reasons["balance"] == 32

    cands.append(Cand("e4"))
    predicted = {t: balancer.ranking(cands, prompt(t, 9))[0].id for t in range(32)}
    moved: dict[int, str] = {}
    for turn in range(3, 6):
        for t in range(32):
            picked = balancer.pick(cands, usable, None, prompt(t, turn), at=0.0)
            assert picked is not None
            if picked.id != served[t]:
                moved[t] = picked.id
    homes = {**served, **moved}
    counts = Counter(homes.values())
    assert counts["e4"] >= 32 // 5
    assert max(counts.values()) <= math.ceil(32 / 5)
    for t, at in moved.items():
        assert predicted[t] == at or at != "e4"
        order = [c.id for c in CacheAware[Cand]().ranking(cands, prompt(t, 0))]
        assert order.index(at) < order.index(served[t])


def test_generation_change_clears_that_endpoints_prefix_state() -> None:
    cands = [Cand(f"e{i}") for i in range(3)]
    balancer = CacheAware[Cand](affinity_blocks=1)
    blocks = prefix_blocks(b"x" * 4096, 128, 512)
    picked = balancer.pick(cands, usable, None, blocks, at=0.0)
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
    picked = balancer.pick(cands, usable, None, blocks, at=0.0)
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
    first = balancer.pick(cands, usable, None, prefix_blocks(convo + b"]", 128, 512), at=0.0)
    assert first is not None
    # The same conversation grown by a turn goes where its beginning went, even when
    # another endpoint is as idle.
    longer = convo + b',{"role":"user","content":"' + b"u" * 600 + b'"}]'
    for _ in range(5):
        assert balancer.pick(cands, usable, None, prefix_blocks(longer, 128, 512), at=0.0) is first


def test_no_prefix_goes_to_the_least_loaded() -> None:
    cands = [Cand("a", load=5), Cand("b", load=1), Cand("c", load=3)]
    balancer = CacheAware[Cand]()
    assert all(balancer.pick(cands, usable, None, (), at=0.0).id == "b" for _ in range(20))  # type: ignore[union-attr]


def test_make_balancer_takes_the_config() -> None:
    config = CacheAwareConfig(epsilon=0.5, slack=1.5, window=64, shared_homes=True)
    balancer = make_balancer("cache_aware", cache_aware=config)
    assert isinstance(balancer, CacheAware)
    assert (balancer.epsilon, balancer.slack, balancer.window) == (0.5, 1.5, 64)
    assert balancer.shared_homes
    assert not CacheAware[Cand]().shared_homes


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


_text = st.text(max_size=40)
_content = st.one_of(
    _text,
    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _text}), max_size=3),
)
_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": _content},
        optional={"name": _text},
    ),
    min_size=1,
    max_size=5,
)


@given(_messages, st.booleans(), st.booleans(), st.randoms())
def test_the_prompt_text_does_not_depend_on_how_the_json_was_written(
    messages: list[dict[str, Any]], ascii_only: bool, compact: bool, rng: random.Random
) -> None:
    """Two clients writing the same conversation (key order, spacing, escapes) give the
    same prompt text; a conversation's prompt text starts with its earlier turns'."""
    reordered = []
    for message in messages:
        items = list(message.items())
        rng.shuffle(items)
        reordered.append(dict(items))
    one = json.dumps(messages).encode()
    other = json.dumps(
        reordered, ensure_ascii=ascii_only, separators=(",", ":") if compact else None
    ).encode()
    assert prompt_text(one, chat=True) == prompt_text(other, chat=True)
    earlier = json.dumps(messages[:-1]).encode()
    assert prompt_text(one, chat=True).startswith(prompt_text(earlier, chat=True))


def test_the_prompt_text_of_a_completion_and_of_what_does_not_decode() -> None:
    assert prompt_text(b'"caf\\u00e9"', chat=False) == "café".encode()
    assert prompt_text(b"[1, 2]", chat=False) == prompt_text(b"[1,2]", chat=False)
    assert prompt_text(b"[1, 2", chat=False) == b"[1, 2"
    # Different conversations stay apart.
    a = prompt_text(b'[{"role":"user","content":"ab"}]', chat=True)
    b = prompt_text(b'[{"role":"user","content":"a"},{"role":"b","content":""}]', chat=True)
    assert a != b


# Precise matching: what the engines report cached (see test_precise.py).


def test_the_engine_that_holds_the_prompt_takes_it_whatever_the_router_sent() -> None:
    bal: CacheAware[Cand] = CacheAware(rng=random.Random(1))
    cands = [Cand("a"), Cand("b"), Cand("c")]
    prefix = (11, 12, 13)
    home = bal.ranking(cands, prefix)[0]
    other = next(c for c in cands if c is not home)
    # This router never sent the prompt anywhere, but `other`'s engine reports it cached
    # (another router sent it, or this one restarted): it goes there.
    held = {other.id: 6, home.id: 1}
    got = bal.pick(cands, lambda c: True, None, prefix, lambda c: held.get(c.id, 1), at=0.0)
    assert got is other
    assert bal.engine_cache_picks == 1
    # What every engine holds (the chat template's head) makes no holder: home.
    fresh: CacheAware[Cand] = CacheAware(rng=random.Random(1))
    assert fresh.pick(cands, lambda c: True, None, prefix, lambda c: 2, at=0.0) is home
    assert fresh.engine_cache_picks == 0
    # No engine reports its cache (-1): the router's own history decides, as before.
    assert fresh.pick(cands, lambda c: True, None, prefix, lambda c: -1, at=0.0) is home


@settings(max_examples=300, deadline=None)
@given(
    loads=st.lists(st.integers(0, 12), min_size=2, max_size=6),
    held=st.lists(st.integers(-1, 8), min_size=6, max_size=6),
    prefix=st.lists(st.integers(0, 2**40), min_size=1, max_size=4),
)
def test_bounded_load_holds_with_the_engines_caches(
    loads: list[int], held: list[int], prefix: list[int]
) -> None:
    """However the engines' caches point, the pick stays within the bound whenever some
    endpoint is, and a holder of the longest match within the bound is preferred to none."""
    bal: CacheAware[Cand] = CacheAware(rng=random.Random(0))
    cands = [Cand(f"e{i}", load=float(x), outstanding=x) for i, x in enumerate(loads)]
    by_id = {c.id: held[i] for i, c in enumerate(cands)}
    got = bal.pick(cands, lambda c: True, None, tuple(prefix), lambda c: by_id[c.id], at=0.0)
    assert got is not None
    total = sum(c.load for c in cands)
    n = len(cands)
    within = [c for c in cands if bal.within(c.load, total, 1, n, n)]
    if within:
        assert got in within
