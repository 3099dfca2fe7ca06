"""Tenants' pure logic: token buckets and reservations (limits.py), the fair-share
queue (fair.py), OpenAI's reset format, and the config's rules."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_proto.config import ConfigError, Duration, load
from llmgw_proto.v1 import ApiKey as WireKey
from llmgw_proto.v1 import KeySet, UsageReply
from llmgw_router.config import ApiKey, RouterConfig, resolve_api_keys, validate
from llmgw_router.control.keys import KeysClient
from llmgw_router.endpoints import Endpoint, EndpointSet, EndpointSpec, EngineLoad
from llmgw_router.metrics import Metrics
from llmgw_router.state import RouterState, now
from llmgw_router.tenants.config import QueueConfig, TenantsConfig
from llmgw_router.tenants.fair import FairQueue
from llmgw_router.tenants.gate import Share, Tenancy, Usage, estimate_tokens, lookup_secret
from llmgw_router.tenants.limits import KeyLimits, KeyState, Refusal, Reservation, reset_text
from llmgw_router.workers.merge import MetricsMerger

# ---------------------------------------------------------------------------- limits


def test_rpm_refuses_past_the_limit_and_refills() -> None:
    ks = KeyState(KeyLimits(rpm=3), now=0.0)
    for _ in range(3):
        assert isinstance(ks.try_reserve(0, 0.0), Reservation)
    refused = ks.try_reserve(0, 0.0)
    assert isinstance(refused, Refusal)
    assert refused.limit == "rpm"
    # One request comes back every 20 s (3 per minute).
    assert refused.retry_after == pytest.approx(20.0)
    assert isinstance(ks.try_reserve(0, 20.0), Reservation)


def test_tokens_reserved_then_corrected_by_usage() -> None:
    ks = KeyState(KeyLimits(tpm=1000), now=0.0)
    got = ks.try_reserve(600, 0.0)
    assert isinstance(got, Reservation)
    assert isinstance(ks.try_reserve(600, 0.0), Refusal)
    ks.release(got, 100, 0.0)  # used 100 of the 600 reserved: 500 back
    assert ks.tokens is not None
    assert ks.tokens.level == pytest.approx(900)
    assert isinstance(ks.try_reserve(600, 0.0), Reservation)


def test_request_larger_than_tpm_is_refused_for_good() -> None:
    ks = KeyState(KeyLimits(tpm=100), now=0.0)
    refused = ks.try_reserve(500, 0.0)
    assert isinstance(refused, Refusal)
    assert refused.limit == "too_large"


def test_concurrency_and_budget() -> None:
    ks = KeyState(KeyLimits(max_concurrent=1, budget_tokens=100), now=0.0)
    ks.grant(100)
    first = ks.try_reserve(60, 0.0)
    assert isinstance(first, Reservation)
    refused = ks.try_reserve(10, 0.0)
    assert isinstance(refused, Refusal)
    assert refused.limit == "concurrency"
    ks.release(first, 50, 0.0)
    assert ks.budget_left == 50
    refused = ks.try_reserve(60, 0.0)
    assert isinstance(refused, Refusal)
    assert refused.limit == "budget"


def test_headers_are_openais() -> None:
    ks = KeyState(KeyLimits(rpm=60, tpm=6000), now=0.0)
    ks.try_reserve(100, 0.0)
    headers = dict(ks.headers(0.0))
    assert headers[b"x-ratelimit-limit-requests"] == b"60"
    assert headers[b"x-ratelimit-remaining-requests"] == b"59"
    assert headers[b"x-ratelimit-reset-requests"] == b"1s"
    assert headers[b"x-ratelimit-limit-tokens"] == b"6000"
    assert headers[b"x-ratelimit-remaining-tokens"] == b"5900"
    assert headers[b"x-ratelimit-reset-tokens"] == b"1s"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, b"0s"), (0.02, b"20ms"), (1, b"1s"), (1.2, b"2s"), (360, b"6m0s"), (3723, b"1h2m3s")],
)
def test_reset_text(seconds: float, text: bytes) -> None:
    assert reset_text(seconds) == text


_ops = st.lists(
    st.tuples(
        st.floats(min_value=0, max_value=30),  # time step
        st.integers(min_value=0, max_value=400),  # tokens asked
        st.one_of(st.none(), st.integers(min_value=0, max_value=400)),  # used (None: unknown)
        st.booleans(),  # end the oldest request in flight
    ),
    max_size=80,
)


@given(
    rpm=st.integers(min_value=1, max_value=50),
    tpm=st.integers(min_value=100, max_value=5000),
    conc=st.integers(min_value=0, max_value=5),
    ops=_ops,
)
@settings(max_examples=200, deadline=None)
def test_reservations_never_exceed_a_limit(
    rpm: int, tpm: int, conc: int, ops: list[tuple[float, int, int | None, bool]]
) -> None:
    """Over any run, what was admitted up to time t is at most the bucket's capacity plus
    its refill since the start, plus what was given back; in flight never above max_concurrent."""
    ks = KeyState(KeyLimits(rpm=rpm, tpm=tpm, max_concurrent=conc), now=0.0)
    t = 0.0
    admitted_requests = 0
    admitted_tokens = 0
    refunded = 0
    live: list[tuple[Reservation, int | None]] = []
    for step, tokens, used, end in ops:
        t += step
        got = ks.try_reserve(tokens, t)
        if isinstance(got, Reservation):
            admitted_requests += 1
            admitted_tokens += tokens
            live.append((got, used))
        assert admitted_requests <= rpm + t * rpm / 60 + 1e-6
        assert admitted_tokens - refunded <= tpm + t * tpm / 60 + 1e-6
        assert ks.in_flight == len(live)
        if conc:
            assert ks.in_flight <= conc
        if end and live:
            reservation, actual = live.pop(0)
            ks.release(reservation, actual, t)
            if actual is not None:
                # An overrun is taken from the bucket: it only makes later admission
                # stricter; what was given back is the capacity that came again.
                refunded += max(0, reservation.tokens - actual)


@given(
    limits=st.builds(
        KeyLimits,
        rpm=st.floats(min_value=0, max_value=1e6),
        tpm=st.floats(min_value=0, max_value=1e9),
        max_concurrent=st.integers(min_value=0, max_value=1000),
    ),
    fraction=st.floats(min_value=1e-6, max_value=1),
)
def test_a_part_of_a_limit_is_never_unlimited(limits: KeyLimits, fraction: float) -> None:
    part = limits.scaled(fraction)
    for name in ("rpm", "tpm", "max_concurrent"):
        whole, share = getattr(limits, name), getattr(part, name)
        assert bool(whole) == bool(share)
        assert share <= max(whole, 1)


# ---------------------------------------------------------------------------- fair queue


def test_flooding_key_waits_behind_itself() -> None:
    q: FairQueue[str] = FairQueue(1)
    for i in range(100):
        q.push(f"a{i}", 0, "a")
    q.push("b0", 0, "b")
    order = [held.item for held in iter(q.pop, None)]
    assert order.index("b0") <= 2


def test_weights_share_in_proportion() -> None:
    q: FairQueue[str] = FairQueue(1)
    for i in range(300):
        q.push(f"a{i}", 0, "a", weight=3)
        q.push(f"b{i}", 0, "b", weight=1)
    first = [q.pop() for _ in range(200)]
    served_a = sum(1 for h in first if h is not None and h.key == "a")
    assert 145 <= served_a <= 155  # 3 : 1


def test_shed_takes_the_newest_of_the_lowest_band() -> None:
    q: FairQueue[str] = FairQueue(3)
    q.push("hi", 0, "k")
    q.push("batch-old", 2, "k")
    q.push("batch-new", 2, "k")
    q.push("mid", 1, "k")
    victim = q.shed()
    assert victim is not None
    assert victim.item == "batch-new"
    assert [h.item for h in iter(q.pop, None)] == ["hi", "mid", "batch-old"]


_queue_ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("push"),
            st.integers(min_value=0, max_value=2),
            st.sampled_from("abcd"),
            st.integers(min_value=1, max_value=5),
        ),
        st.tuples(st.just("pop"), st.just(0), st.just(""), st.just(0)),
        st.tuples(
            st.just("remove"), st.integers(min_value=0, max_value=50), st.just(""), st.just(0)
        ),
    ),
    max_size=200,
)


@given(ops=_queue_ops)
@settings(max_examples=300, deadline=None)
def test_bands_in_order_and_lengths_kept(ops: list[tuple[str, int, str, int]]) -> None:
    """A pop never serves a band while a higher one holds anything; len and lengths()
    always count exactly the live items."""
    q: FairQueue[int] = FairQueue(3)
    live: dict[int, tuple[int, str]] = {}
    handles = []
    n = 0
    for op, band, key, weight in ops:
        if op == "push":
            handles.append(q.push(n, band, key, weight))
            live[n] = (band, key)
            n += 1
        elif op == "pop":
            band_next = q.next_band()
            held = q.pop()
            if held is None:
                assert not live
                assert band_next is None
                continue
            assert held.band == band_next
            assert all(b >= held.band for b, _ in live.values())
            del live[held.item]
        elif handles:
            h = handles[band % len(handles)]
            if q.remove(h):
                del live[h.item]
        assert len(q) == len(live)
        counted: dict[tuple[int, str], int] = {}
        for b, k in live.values():
            counted[(b, k)] = counted.get((b, k), 0) + 1
        per_band = q.lengths()
        assert {(b, k): c for b, d in enumerate(per_band) for k, c in d.items()} == counted


@given(
    backlog=st.integers(min_value=0, max_value=200),
    weights=st.tuples(st.integers(min_value=1, max_value=8), st.integers(min_value=1, max_value=8)),
)
def test_no_key_starves(backlog: int, weights: tuple[int, int]) -> None:
    """However long another key's backlog, a newcomer is served within about one
    request of the other key per its weight ratio: never after the backlog."""
    wa, wb = weights
    q: FairQueue[str] = FairQueue(1)
    for i in range(backlog):
        q.push(f"a{i}", 0, "a", wa)
    # Some of the backlog served already, then b arrives.
    for _ in range(backlog // 2):
        q.pop()
    q.push("b", 0, "b", wb)
    position = 0
    while True:
        held = q.pop()
        assert held is not None
        if held.item == "b":
            break
        position += 1
    assert position <= math.ceil(wa / wb) + 1


# ---------------------------------------------------------------------------- parts


def test_estimate_counts_prompt_and_completion_bound() -> None:
    body = b'{"model": "m", "prompt": "' + b"x" * 400 + b'", "max_tokens": 50}'
    assert estimate_tokens(body, 256) == len(body) // 4 + 50
    body = b'{"model": "m", "max_completion_tokens": 7, "messages": []}'
    assert estimate_tokens(body, 256) == len(body) // 4 + 7
    assert estimate_tokens(b'{"model": "m"}', 256) == 14 // 4 + 256
    assert estimate_tokens(b"not json", 16) == 2 + 16


def test_control_key_found_by_prefix_and_hash() -> None:
    secret = b"llmgw_3f9a1c2b_s3cr3t_with_underscores"
    key = ApiKey(
        b"",
        "team-a",
        frozenset(),
        prefix="llmgw_3f9a1c2b",
        sha256=hashlib.sha256(secret).hexdigest(),
        local=False,
    )
    table = {key.prefix: key}
    assert lookup_secret(table, secret) is key
    assert lookup_secret(table, secret + b"x") is None
    assert lookup_secret(table, b"llmgw_00000000_s3cr3t") is None
    assert lookup_secret(table, b"sk-other") is None


def _load(tmp_path: Path, text: str) -> RouterConfig:
    path = tmp_path / "router.yaml"
    path.write_text(text)
    return load(path, RouterConfig)


def test_config_keys_take_limits(tmp_path: Path) -> None:
    cfg = _load(
        tmp_path,
        "api_keys:\n"
        "  - {key: k1, name: team-a, rpm: 10, tpm: 1000, max_concurrent: 2,"
        " priority: batch, weight: 3, budget_tokens: 5000, budget_period: day}\n",
    )
    (key,) = resolve_api_keys(validate(cfg, "router.yaml"), "router.yaml")
    assert key.limits == KeyLimits(rpm=10, tpm=1000, max_concurrent=2, budget_tokens=5000)
    assert (key.priority, key.weight, key.budget_period) == ("batch", 3, "day")


def test_config_names_an_unknown_priority(tmp_path: Path) -> None:
    cfg = _load(tmp_path, "api_keys:\n  - {key: k1, priority: urgent}\n")
    with pytest.raises(ConfigError) as err:
        resolve_api_keys(cfg, "router.yaml")
    assert "$.api_keys[0].priority" in str(err.value)
    assert "urgent" in str(err.value)


def test_config_names_a_default_priority_not_in_bands(tmp_path: Path) -> None:
    cfg = _load(tmp_path, "tenants: {bands: [hi, lo], default_priority: default}\n")
    with pytest.raises(ConfigError) as err:
        validate(cfg, "router.yaml")
    assert "$.tenants.default_priority" in str(err.value)


# ---------------------------------------------------------------------------- Tenancy


def _tenancy(workers: int = 1, **tenants: Any) -> Tenancy:
    config = RouterConfig(tenants=TenantsConfig(**tenants))
    state = RouterState(config, EndpointSet((), source="static"), Metrics())
    return Tenancy(state, config.tenants, workers)


def test_config_limits_are_divided_among_workers() -> None:
    key = ApiKey(b"k", "a", frozenset(), limits=KeyLimits(rpm=100, max_concurrent=8))
    assert _tenancy(workers=4).limits_for(key, 0.0) == KeyLimits(rpm=25, max_concurrent=2)
    assert _tenancy(workers=1).limits_for(key, 0.0) == key.limits


def test_control_key_takes_its_share_then_the_fallback() -> None:
    tenancy = _tenancy(workers=2, fallback_fraction=0.5)
    key = ApiKey(b"", "a", frozenset(), limits=KeyLimits(rpm=100), local=False)
    # No share yet: the fallback fraction, divided among the workers.
    assert tenancy.limits_for(key, now()).rpm == 25
    tenancy.apply_shares([("a", Share(rpm=10, tpm=0, max_concurrent=0, budget_tokens=0))], 5.0)
    assert tenancy.limits_for(key, now()).rpm == 10
    # Past valid_for with no new reply: the fallback again.
    assert tenancy.limits_for(key, now() + 6.0).rpm == 25
    # A share of 0 for a limited key is never "unlimited".
    tenancy.apply_shares([("a", Share(rpm=0, tpm=0, max_concurrent=0, budget_tokens=0))], 5.0)
    assert tenancy.limits_for(key, now()).rpm == 1


def test_usage_report_is_resent_unchanged_until_answered() -> None:
    tenancy = _tenancy()
    client = KeysClient(tenancy, "r1")
    tenancy.usage["a"] = Usage(requests=3)
    first = client.next_report()
    tenancy.usage["a"] = Usage(requests=5)
    # No answer: the same report again (same sequence), the new usage waits.
    again = client.next_report()
    assert again is first
    assert [(u.key, u.requests) for u in again.usage] == [("a", 3)]
    client.answered(UsageReply())
    nxt = client.next_report()
    assert nxt.sequence == first.sequence + 1
    assert nxt.instance == first.instance
    assert [(u.key, u.requests) for u in nxt.usage] == [("a", 5)]


async def _yield(times: int = 5) -> None:
    for _ in range(times):
        await asyncio.sleep(0)


async def test_a_held_request_that_leaves_gives_its_place_back() -> None:
    tenancy = _tenancy(queue=QueueConfig(per_endpoint=1, max_wait=Duration(30.0)))
    ep = Endpoint(spec=EndpointSpec(id="e", url="http://127.0.0.1:1", models=("m",)))
    first = await tenancy.admit(None, "m", (ep,), b"{}")
    gate = tenancy.gates["m"]
    assert gate.in_flight == 1
    # Held, then its client leaves: out of the queue, nothing counted in flight.
    held = asyncio.create_task(tenancy.admit(None, "m", (ep,), b"{}"))
    await _yield()
    assert len(gate.queue) == 1
    held.cancel()
    with pytest.raises(asyncio.CancelledError):
        await held
    assert (gate.in_flight, len(gate.queue)) == (1, 0)
    # Let go by the first one's end, then cancelled before it ran: the place goes back.
    held = asyncio.create_task(tenancy.admit(None, "m", (ep,), b"{}"))
    await _yield()
    tenancy.done(first, 1, 1, 200)
    assert gate.in_flight == 1
    held.cancel()
    with pytest.raises(asyncio.CancelledError):
        await held
    assert (gate.in_flight, len(gate.queue)) == (0, 0)
    await tenancy.close()


def test_workers_queue_lengths_add_up() -> None:
    def scrape(held: int) -> str:
        return (
            "# HELP llmgw_router_queue_length held\n# TYPE llmgw_router_queue_length gauge\n"
            f'llmgw_router_queue_length{{key="a",priority="batch"}} {held}.0\n'
        )

    merger = MetricsMerger()
    text = merger.render(merger.merge({1: scrape(3), 2: scrape(4)})).decode()
    assert 'llmgw_router_queue_length{key="a",priority="batch"} 7.0' in text


async def test_headroom_lets_a_higher_band_past_a_full_lower_one() -> None:
    tenancy = _tenancy(queue=QueueConfig(per_endpoint=1, headroom=1, max_wait=Duration(30.0)))
    ep = Endpoint(spec=EndpointSpec(id="e", url="http://127.0.0.1:1", models=("m",)))
    batch = ApiKey(b"b", "bulk", frozenset(), priority="batch")
    chat = ApiKey(b"c", "chat", frozenset(), priority="interactive")
    first = await tenancy.admit(batch, "m", (ep,), b"{}")
    # The lowest band is at the cap: a second batch request is held ...
    held = asyncio.create_task(tenancy.admit(batch, "m", (ep,), b"{}"))
    await _yield()
    gate = tenancy.gates["m"]
    assert (gate.in_flight, len(gate.queue)) == (1, 1)
    # ... while an interactive one goes at once, into the headroom.
    second = await tenancy.admit(chat, "m", (ep,), b"{}")
    assert (gate.in_flight, len(gate.queue)) == (2, 1)
    # Two in flight: the held batch request waits until one of them ends, and then
    # until the lowest band's cap is free again.
    tenancy.done(second, 1, 1, 200)
    assert not held.done()
    tenancy.done(first, 1, 1, 200)
    third = await held
    assert gate.in_flight == 1
    tenancy.done(third, 1, 1, 200)
    await tenancy.close()


class _FakeStream:
    """One call on :class:`_FakeChannel`: it breaks at once, or streams key sets."""

    def __init__(self, broken: bool, sets: list[KeySet]) -> None:
        self.broken = broken
        self.sets = sets

    async def __aenter__(self) -> _FakeStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def send_message(self, message: object, end: bool = False) -> None:
        if self.broken:
            raise ConnectionResetError("connection reset by peer")

    async def _each(self) -> AsyncIterator[KeySet]:
        for keyset in self.sets:
            yield keyset
        await asyncio.Event().wait()

    def __aiter__(self) -> AsyncIterator[KeySet]:
        return self._each()


class _FakeChannel:
    def __init__(self, sets: list[KeySet]) -> None:
        self.calls = 0
        self.sets = sets

    def request(self, *args: object, **kwargs: object) -> _FakeStream:
        self.calls += 1
        return _FakeStream(self.calls == 1, self.sets)


async def test_a_broken_key_stream_is_tried_again() -> None:
    tenancy = _tenancy()
    client = KeysClient(tenancy, "r1", backoff=(0.01, 0.01))
    wire = WireKey(name="a", prefix="llmgw_0a1b2c3d", sha256="ab" * 32, rpm=5)
    channel = _FakeChannel([KeySet(version=7, keys=[wire])])
    task = asyncio.create_task(client.watch(channel))  # type: ignore[arg-type]
    try:
        deadline = asyncio.get_running_loop().time() + 10
        while tenancy.keys_version != 7:
            assert not task.done(), task
            assert asyncio.get_running_loop().time() < deadline, "no key set after a reset"
            await asyncio.sleep(0.01)
        assert set(tenancy.by_prefix) == {"llmgw_0a1b2c3d"}
        assert channel.calls == 2
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_headroom_lets_a_light_key_past_a_flooding_one() -> None:
    tenancy = _tenancy(queue=QueueConfig(per_endpoint=2, headroom=1, max_wait=Duration(30.0)))
    ep = Endpoint(spec=EndpointSpec(id="e", url="http://127.0.0.1:1", models=("m",)))
    flood = ApiKey(b"f", "flood", frozenset())
    light = ApiKey(b"l", "light", frozenset())
    running = [await tenancy.admit(flood, "m", (ep,), b"{}") for _ in range(2)]
    held = [asyncio.create_task(tenancy.admit(flood, "m", (ep,), b"{}")) for _ in range(3)]
    await _yield()
    gate = tenancy.gates["m"]
    assert (gate.in_flight, len(gate.queue)) == (2, 3)
    # The light key has nothing in flight, below its share (1 of 2 keys x 2): it goes at
    # once into the headroom, past the flood's held requests, which stay held.
    light_ticket = await tenancy.admit(light, "m", (ep,), b"{}")
    assert (gate.in_flight, len(gate.queue)) == (3, 3)
    # The flood gets no headroom: one of its own ending leaves the cap full (the light
    # key's request counts), so none of its held ones goes ...
    tenancy.done(running.pop(), 1, 1, 200)
    await _yield()
    assert (gate.in_flight, len(gate.queue)) == (2, 3)
    # ... until the light one ends too.
    tenancy.done(light_ticket, 1, 1, 200)
    await _yield()
    assert (gate.in_flight, len(gate.queue)) == (2, 2)
    for task in held:
        task.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    await tenancy.close()


def test_full_when_every_engine_reports_requests_waiting() -> None:
    tenancy = _tenancy(queue=QueueConfig(engine_waiting=2))
    a, b = (
        Endpoint(spec=EndpointSpec(id=i, url="http://127.0.0.1:1", models=("m",)))
        for i in ("a", "b")
    )
    gate = tenancy._gate("m", (a, b))
    at = now()
    # Unknown figures: not full (the router does not hold on a guess).
    assert not tenancy.full(gate, at)
    a.report(EngineLoad(waiting=3, measured_at=at))
    assert not tenancy.full(gate, at)
    b.report(EngineLoad(waiting=1, measured_at=at))
    assert not tenancy.full(gate, at)
    b.report(EngineLoad(waiting=2, measured_at=at))
    assert tenancy.full(gate, at)
    # Figures older than load_reports.max_age count as unknown.
    assert not tenancy.full(gate, at + 60)


@given(per_endpoint=st.integers(0, 100_000), headroom=st.none() | st.integers(0, 100_000))
def test_headroom_defaults_to_a_quarter_of_the_cap(per_endpoint: int, headroom: int | None) -> None:
    queue = QueueConfig(per_endpoint=per_endpoint, headroom=headroom)
    assert queue.room == (per_endpoint // 4 if headroom is None else headroom)
    assert _tenancy(queue=queue).headroom == queue.room


def test_headroom_unset_in_a_config_file(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("tenants: {queue: {per_endpoint: 24}}\n")
    assert load(path, RouterConfig).tenants.queue.room == 6
    path.write_text("tenants: {queue: {per_endpoint: 24, headroom: 0}}\n")
    assert load(path, RouterConfig).tenants.queue.room == 0
