"""KV-cache events: vLLM's own encoding decoded, and relayed from a real ZMQ publisher."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio
from llmgw_agent.engine_flags import captured
from llmgw_agent.kv_events import KvEventsRelay, KvSource, decode_batch, kv_events_target
from llmgw_proto import v1
from llmgw_testkit import free_port, wait_for_async

DATA = Path(__file__).parent / "data"
# sha256(b"a") and sha256(b"b") as 64-bit integers (their low 64 bits, as vLLM's
# VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES gives them).
HASH_A = 13366815110101616827
HASH_B = 14660323646696587421


def test_batches_encoded_by_vllm_0_32_itself() -> None:
    # Written by vLLM 0.32.0's own KVEventBatch/BlockStored/BlockRemoved and msgspec.
    delta = decode_batch((DATA / "vllm-0.32.0-kv-events.msgpack").read_bytes())
    assert delta.stored == [HASH_A, HASH_B]
    assert delta.removed == [HASH_A]
    assert not delta.cleared
    assert delta.block_size == 16
    cleared = decode_batch((DATA / "vllm-0.32.0-kv-events-cleared.msgpack").read_bytes())
    assert cleared.cleared
    assert cleared.stored == [12345]  # stored after the clear: kept


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
    relay = KvEventsRelay(lambda: [source], sent.append, interval=lambda: 0.05, session=lambda: 1)
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
            return any(HASH_B in m.stored for m in sent)

        await wait_for_async(arrived, timeout=30, what="the relayed BlockStored")
        assert sent[0].cleared
        assert sent[0].shard_id == "m.p.1-0"
        assert sent[0].generation == 99
        assert any(m.block_size == 16 for m in sent)
        # A lost batch (sequence gap): the receiver is told to forget this engine's blocks.
        before = len(sent)
        await pub.send_multipart([b"kv", (seq + 5).to_bytes(8, "big"), stored])

        async def cleared_again() -> bool:
            return any(m.cleared for m in sent[before:])

        await wait_for_async(cleared_again, timeout=30, what="a clear after the gap")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.close()
