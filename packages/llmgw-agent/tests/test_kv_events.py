"""KV-cache events: vLLM's own encoding decoded, and relayed from a real ZMQ publisher."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from hypothesis import given
from hypothesis import strategies as st
from llmgw_agent.engine_flags import captured
from llmgw_agent.kv_events import (
    CacheView,
    KvEvent,
    KvEventsRelay,
    KvSource,
    decode_batch,
    decode_events,
    kv_events_target,
)
from llmgw_proto import v1
from llmgw_proto.token_blocks import root, token_block_hashes
from llmgw_testkit import free_port, wait_for_async

DATA = Path(__file__).parent / "data"
# sha256(b"a") and sha256(b"b") as 64-bit integers (their low 64 bits, as vLLM's
# VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES gives them).
HASH_A = 13366815110101616827
HASH_B = 14660323646696587421


# The same blocks as named by token_blocks: tokens 0..15, then 16..31 chained on it.
NAME_A, NAME_B = token_block_hashes(range(32), 16)


def test_batches_encoded_by_vllm_0_32_itself() -> None:
    # Written by vLLM 0.32.0's own KVEventBatch/BlockStored/BlockRemoved and msgspec:
    # two blocks stored (with their token ids), the first removed.
    events = decode_events((DATA / "vllm-0.32.0-kv-events.msgpack").read_bytes())
    assert [e.kind for e in events] == ["BlockStored", "BlockRemoved"]
    assert events[0].hashes == (HASH_A, HASH_B)
    assert events[0].tokens == tuple(range(32))
    assert events[1].hashes == (HASH_A,)
    delta = decode_batch((DATA / "vllm-0.32.0-kv-events.msgpack").read_bytes())
    # Named by their token ids, which a router can compute, not by vLLM's seeded hash.
    assert delta.token_hashes
    assert delta.stored == [NAME_A, NAME_B]
    assert delta.removed == [NAME_A]
    assert not delta.cleared
    assert delta.block_size == 16
    cleared = decode_batch((DATA / "vllm-0.32.0-kv-events-cleared.msgpack").read_bytes())
    assert cleared.cleared
    assert cleared.stored == [NAME_A]  # stored after the clear: kept


def _stored(hashes: list[int], tokens: list[int], parent: int | None = None, **kw: Any) -> KvEvent:
    return KvEvent("BlockStored", tuple(hashes), parent, tuple(tokens), 4, **kw)


def test_a_view_chains_names_through_the_engines_parent_hashes() -> None:
    view = CacheView()
    first = view.apply([_stored([101, 102], list(range(8)))])
    assert first.stored == token_block_hashes(range(8), 4)
    # The next event names its parent by the engine's hash; the chain goes on from it.
    second = view.apply([_stored([103], [8, 9, 10, 11], parent=102)])
    assert second.stored == token_block_hashes(range(12), 4)[2:]
    # Stored again (a reused block, or a second group's copy in the same group): once.
    assert view.apply([_stored([101], [0, 1, 2, 3])]).stored == []
    # A block whose parent was never seen cannot be named: left out.
    assert view.apply([_stored([200], [7, 7, 7, 7], parent=999)]).stored == []
    removed = view.apply([KvEvent("BlockRemoved", (102, 999))])
    assert removed.removed == [token_block_hashes(range(8), 4)[1]]
    assert len(view) == 2
    snap = view.snapshot()
    assert snap.cleared
    assert sorted(snap.stored) == sorted([token_block_hashes(range(12), 4)[i] for i in (0, 2)])


def test_a_view_leaves_out_groups_that_cache_no_prefix_and_keys_lora_blocks_apart() -> None:
    view = CacheView()
    sliding = view.apply(
        [
            _stored([1], [0, 1, 2, 3], group=1, spec_kind="sliding_window"),
            KvEvent("BlockRemoved", (1,), group=1),
        ]
    )
    assert not sliding.stored
    assert not sliding.removed
    full = view.apply([_stored([1], [0, 1, 2, 3], group=0, spec_kind="full_attention")])
    lora = view.apply([_stored([2], [0, 1, 2, 3], lora_name="sql")])
    assert full.stored == token_block_hashes(range(4), 4)
    assert lora.stored == token_block_hashes(range(4), 4, parent=root("sql"))
    assert lora.stored != full.stored
    # Without token ids (the simulator's events) the engine's own hashes stand.
    plain = CacheView().apply([KvEvent("BlockStored", (5, 6), None, (), 16)])
    assert plain.stored == [5, 6]
    assert not plain.token_hashes


@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(0, 5), st.integers(0, 1)), min_size=1, max_size=60
    )
)
def test_a_view_relays_exactly_what_it_holds(ops: list[tuple[bool, int, int]]) -> None:
    """Whatever order blocks are stored and removed in (two groups holding the same
    tokens among them), the stored and removed names relayed add up to what the view
    holds: a receiver applying the deltas ends with the view's own snapshot."""
    view = CacheView()
    receiver: set[int] = set()
    for store, block, group in ops:
        tokens = [block] * 4
        if store:
            event = _stored([block * 10 + group], tokens, group=group)
        else:
            event = KvEvent("BlockRemoved", (block * 10 + group,), group=group)
        delta = view.apply([event])
        assert not set(delta.stored) & receiver  # never stored twice
        assert set(delta.removed) <= receiver  # never removed what was not held
        receiver |= set(delta.stored)
        receiver -= set(delta.removed)
    assert receiver == set(view.snapshot().stored)


def test_not_a_batch_is_a_value_error() -> None:
    for payload in (b"\xc1", msgspec.msgpack.encode({"a": 1}), msgspec.msgpack.encode([1])):
        try:
            decode_batch(payload)
        except ValueError:
            continue
        raise AssertionError(f"accepted {payload!r}")


def test_the_profile_says_where_events_are_published() -> None:
    spec = captured("vllm", "0.32.0")
    on = spec.parse(
        [
            "--kv-events-config",
            '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5601",'
            ' "topic": "kv"}',
        ]
    )
    assert kv_events_target(on) == ("tcp://127.0.0.1:5601", "kv")
    default = spec.parse(["--kv-events-config", '{"enable_kv_cache_events": true}'])
    assert kv_events_target(default) == ("tcp://127.0.0.1:5557", "")
    off = spec.parse(["--kv-events-config", '{"enable_kv_cache_events": false}'])
    assert kv_events_target(off) is None
    assert kv_events_target(spec.parse([])) is None


async def test_relay_from_a_real_zmq_publisher() -> None:
    port = free_port()
    context = zmq.asyncio.Context.instance()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    sent: list[v1.CacheEvents] = []
    source = KvSource("m.p.1-0", f"tcp://127.0.0.1:{port}", "kv", generation=99)
    session = [1]
    relay = KvEventsRelay(
        lambda: [source], sent.append, interval=lambda: 0.05, session=lambda: session[0]
    )
    task = asyncio.create_task(relay.run())
    stored = (DATA / "vllm-0.32.0-kv-events.msgpack").read_bytes()
    try:
        # A new engine starts with a clear; ZMQ subscribers join late, so publish until
        # the first batch arrives (each with the next sequence number).
        seq = 0

        async def arrived() -> bool:
            nonlocal seq
            seq += 1
            await pub.send_multipart([b"kv", seq.to_bytes(8, "big"), stored])
            return any(NAME_B in m.stored for m in sent)

        await wait_for_async(arrived, timeout=30, what="the relayed BlockStored")
        assert sent[0].cleared
        assert sent[0].shard_id == "m.p.1-0"
        assert sent[0].generation == 99
        assert any(m.block_size == 16 for m in sent)
        assert all(m.token_hashes for m in sent if m.stored)
        # A lost batch (sequence gap): the receiver is told to forget this engine's blocks.
        before = len(sent)
        await pub.send_multipart([b"kv", (seq + 5).to_bytes(8, "big"), stored])

        async def cleared_again() -> bool:
            return any(m.cleared for m in sent[before:])

        await wait_for_async(cleared_again, timeout=30, what="a clear after the gap")
        # The view starts over from the next batch; a new stream to the control plane
        # then gets everything held, not only what changes next.
        await pub.send_multipart([b"kv", (seq + 6).to_bytes(8, "big"), stored])

        async def rebuilt() -> bool:
            return relay.view(source).snapshot().stored == [NAME_B]

        await wait_for_async(rebuilt, timeout=30, what="the view rebuilt after the gap")
        before = len(sent)
        session[0] = 2

        async def snapshot() -> bool:
            return any(m.cleared and m.stored == [NAME_B] for m in sent[before:])

        await wait_for_async(snapshot, timeout=30, what="the whole view on a new stream")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.close()


def test_port_0_leaves_the_kv_events_port_to_the_agent() -> None:
    from llmgw_agent.adapters import Launch, wants_kv_port, with_kv_port

    raw = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:0"}'
    launch = Launch(
        argv=["vllm", "serve", "m", "--kv-events-config", raw, "--x"],
        env={},
        health_url="",
        metrics_url="",
        endpoint_url="",
        headless=False,
        kv_events_endpoint="tcp://127.0.0.1:0",
    )
    assert wants_kv_port(launch)
    moved = with_kv_port(launch, 6123)
    assert not wants_kv_port(moved)
    assert moved.kv_events_endpoint == "tcp://127.0.0.1:6123"
    config = json.loads(moved.argv[4])
    assert config["endpoint"] == "tcp://*:6123"
    assert config["enable_kv_cache_events"] is True
    assert moved.argv[5] == "--x"
    inline = with_kv_port(
        msgspec.structs.replace(launch, argv=["vllm", f"--kv-events-config={raw}"]), 7000
    )
    assert json.loads(inline.argv[1].split("=", 1)[1])["endpoint"] == "tcp://*:7000"
