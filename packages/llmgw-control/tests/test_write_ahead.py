"""Write-ahead: a command goes to an agent only once the state store holds its reason.

A control plane killed (SIGKILL) right after a pass must come back knowing every
replica it started and every drain it began: else the restarted one publishes stale
endpoints (fewer than were serving, in a rollout) or starts one more replica than
``max_surge`` allows. The controller holds a pass's commands until
:meth:`Persister.durable` says the pass's records are written; a store that is down
delays them by at most the write-ahead timeout, it does not stop them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_control.config import ControlConfig, Loaded, check
from llmgw_control.controller import Controller
from llmgw_control.inventory import Node
from llmgw_control.placement import GpuSlot
from llmgw_control.store.base import Change, StoreError
from llmgw_control.store.keeper import StateKeeper
from llmgw_control.store.persist import REPLICA, Clock, Persister, decode_state
from llmgw_proto import v1
from llmgw_proto.config import convert
from llmgw_testkit import wait_for_async

GiB = 2**30


class GatedStore:
    """A store in memory whose writes wait for ``gate`` (open by default) and may fail."""

    description = "gated memory store"

    def __init__(self) -> None:
        self.records: dict[tuple[str, str], bytes] = {}
        self.gate = asyncio.Event()
        self.gate.set()
        self.writing = asyncio.Event()
        self.fail: StoreError | None = None
        self.batches = 0

    async def open(self) -> None:
        return None

    async def load(self) -> dict[str, dict[str, bytes]]:
        out: dict[str, dict[str, bytes]] = {}
        for (kind, key), value in self.records.items():
            out.setdefault(kind, {})[key] = value
        return out

    async def write(self, changes: Sequence[Change]) -> None:
        self.writing.set()
        await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        self.batches += 1
        for c in changes:
            if c.value is None:
                self.records.pop((c.kind, c.key), None)
            else:
                self.records[(c.kind, c.key)] = c.value

    async def close(self) -> None:
        return None


# --- the persister ------------------------------------------------------------------


async def test_durable_writes_at_once_and_waits_for_the_write() -> None:
    store = GatedStore()
    p = Persister(store, flush_every=3600.0)  # the batching loop would wait an hour
    p.stage("replica", "r1", b"1")
    store.gate.clear()
    waiting = asyncio.create_task(p.durable(5.0))
    await asyncio.wait_for(store.writing.wait(), 5.0)
    assert not waiting.done(), "durable returned before the store answered"
    store.gate.set()
    assert await waiting is True
    assert store.records == {("replica", "r1"): b"1"}
    # Nothing new staged: nothing to wait for.
    assert await p.durable(5.0) is True
    assert store.batches == 1


async def test_a_value_staged_back_while_a_batch_is_written_is_not_lost() -> None:
    store = GatedStore()
    p = Persister(store)
    p.seed({"replica": {"r": b"A"}})
    p.stage("replica", "r", b"B")
    store.gate.clear()
    first = asyncio.create_task(p.durable(5.0))
    await asyncio.wait_for(store.writing.wait(), 5.0)
    # B is being written; A (what the store held before) is staged again meanwhile.
    p.stage("replica", "r", b"A")
    assert "r" in p.known("replica")
    store.gate.set()
    assert await first is True
    assert await p.durable(5.0) is True
    assert store.records == {("replica", "r"): b"A"}


async def test_durable_is_false_on_a_store_error_and_keeps_the_change() -> None:
    store = GatedStore()
    p = Persister(store)
    store.fail = StoreError("gated memory store: disk full")
    p.stage("replica", "r1", b"1")
    assert await p.durable(5.0) is False
    assert p.pending == 1
    store.fail = None
    assert await p.durable(5.0) is True
    assert store.records == {("replica", "r1"): b"1"}


async def test_durable_gives_up_at_its_timeout() -> None:
    store = GatedStore()
    p = Persister(store)
    p.stage("replica", "r1", b"1")
    store.gate.clear()
    assert await p.durable(0.2) is False
    store.gate.set()
    assert await p.durable(5.0) is True


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("stage"), st.sampled_from("abc"), st.none() | st.sampled_from("xyz")),
        st.tuples(st.just("durable")),
        st.tuples(st.just("yield"), st.integers(0, 3)),
        st.tuples(st.just("fail"), st.booleans()),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_whatever_the_interleaving_a_true_durable_means_the_store_holds_it(
    ops: list[tuple[Any, ...]],
) -> None:
    """The batching loop, durable() and stages interleaved (writes suspend mid-way):
    each True from durable() finds the store holding the last value staged per key."""

    async def scenario() -> None:
        store = GatedStore()
        real_write = store.write

        async def slow_write(changes: Sequence[Change]) -> None:
            await asyncio.sleep(0)  # a batch in flight while the test goes on staging
            await real_write(changes)

        store.write = slow_write  # type: ignore[method-assign]
        p = Persister(store, flush_every=0.001)
        loop_task = asyncio.create_task(p.run())
        want: dict[str, bytes | None] = {}

        def holds() -> bool:
            have = {k: v for (_, k), v in store.records.items()}
            return have == {k: v for k, v in want.items() if v is not None}

        try:
            for op in ops:
                if op[0] == "stage":
                    value = None if op[2] is None else op[2].encode()
                    p.stage("replica", op[1], value)
                    want[op[1]] = value
                elif op[0] == "durable":
                    if await p.durable(2.0):
                        assert holds(), (store.records, want)
                elif op[0] == "yield":
                    for _ in range(op[1]):
                        await asyncio.sleep(0)
                else:
                    store.fail = StoreError("gated memory store: down") if op[1] else None
            store.fail = None
            assert await p.durable(10.0) is True
            assert holds(), (store.records, want)
        finally:
            loop_task.cancel()

    asyncio.run(scenario())


# --- the controller -----------------------------------------------------------------


def controller() -> tuple[Controller, GatedStore]:
    raw = {
        "listen": "127.0.0.1:1",
        "admin_listen": "127.0.0.1:2",
        "tls": {"insecure": True},
        "control": {"startup_grace": "0s", "interval": "50ms", "mgmt_interface": "lo"},
        "models": [{"name": "m", "profiles": {"p": {"engine": "vllm", "replicas": 1}}}],
    }
    config = convert(raw, ControlConfig, source="control.yaml")
    c = Controller(Loaded(config, check(config, "control.yaml")))
    store = GatedStore()
    c.keeper = StateKeeper(store, c.metrics.registry)
    c.inventory.nodes["gpu-a"] = gpu_node()
    return c, store


def gpu_node() -> Node:
    return Node(
        "gpu-a",
        "s1",
        gpus=(GpuSlot(0, "NVIDIA H100", 80 * GiB),),
        interfaces={"lo": ["127.0.0.1"]},
        last_seen=time.monotonic(),
    )


def record_sends(c: Controller) -> list[v1.ControlMessage]:
    sent: list[v1.ControlMessage] = []

    def send(node_id: str, command_id: str, msg: v1.ControlMessage) -> bool:
        sent.append(msg)
        return True

    c.agents.send = send  # type: ignore[method-assign]
    return sent


async def test_a_start_goes_out_only_once_its_replica_is_stored() -> None:
    c, store = controller()
    sent = record_sends(c)
    store.gate.clear()
    c.reconcile_now(force=True)
    assert sent == [], "a command went out in the pass itself"
    holding = asyncio.create_task(c.send_stored())
    await asyncio.wait_for(store.writing.wait(), 5.0)
    await asyncio.sleep(0.05)
    assert sent == [], "a command went out before its records were stored"
    store.gate.set()
    await asyncio.wait_for(holding, 5.0)
    assert len(sent) == 1
    assert sent[0].start_shard is not None
    start = sent[0].start_shard
    # Killed now, the next control plane knows the replica and its revision.
    restored = decode_state(await store.load(), Clock.now(), store.description)
    replica = restored.replicas[start.replica_id]
    assert replica.revision == c.catalog.get("m", "p").revision  # type: ignore[union-attr]
    assert [s.shard_id for s in replica.shards] == [start.shard_id]
    assert (REPLICA, start.replica_id) in store.records


async def test_a_store_that_is_down_does_not_stop_the_commands() -> None:
    c, store = controller()
    sent = record_sends(c)
    store.fail = StoreError("gated memory store: down")
    c.reconcile_now(force=True)
    await asyncio.wait_for(c.send_stored(), 5.0)
    assert len(sent) == 1
    assert sent[0].start_shard is not None


async def test_without_a_store_commands_go_out_in_the_pass() -> None:
    c, _ = controller()
    c.keeper = StateKeeper()
    sent = record_sends(c)
    c.reconcile_now(force=True)
    assert len(sent) == 1
    assert sent[0].start_shard is not None


async def test_a_new_run_does_not_send_what_a_lost_lead_held() -> None:
    c, store = controller()
    sent = record_sends(c)
    store.gate.clear()
    c.reconcile_now(force=True)
    assert len(c._outbox) == 1
    # The lead is lost with the Start held (the run cancelled, the state forgotten), and
    # won again: the new run places anew and sends its own Start, not the old one too.
    c.forget()
    c.keeper.persister = Persister(store)
    c.inventory.nodes["gpu-a"] = gpu_node()
    c._changed()  # as its Register would
    store.gate.set()
    task = asyncio.create_task(c.run())
    try:
        await wait_for_async(_async(lambda: len(sent) >= 1), timeout=10, what="a Start sent")
        ticks = c.ticks
        await wait_for_async(_async(lambda: c.ticks >= ticks + 3), timeout=10, what="passes")
    finally:
        task.cancel()
    assert len(sent) == 1, sent
    assert c.state.replicas[sent[0].start_shard.replica_id]  # type: ignore[union-attr]


def _async(fn: Any) -> Any:
    async def check() -> Any:
        return fn()

    return check
