"""State stores against the real thing: SQLite files, a real etcd, a real PostgreSQL.

Records written come back; a store that cannot be read (a corrupt or foreign file, a
newer schema, an unreachable etcd, a wrong password) is a StoreError that names the
store and the setting, and `llmgw-control serve` stops with exit 2 saying so.
Leadership and fenced writes: test_leadership.py.
"""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_control.config import EtcdSettings, PostgresSettings
from llmgw_control.inventory import Node, NodeState, ShardReport
from llmgw_control.placement import GpuSlot
from llmgw_control.records import Replica, ShardPlan
from llmgw_control.store.base import SCHEMA_VERSION, Change, StoreError
from llmgw_control.store.etcd import EtcdStore
from llmgw_control.store.persist import (
    Clock,
    decode_state,
    encode_node,
    encode_replica,
)
from llmgw_control.store.postgres import PostgresStore
from llmgw_control.store.sqlite import SqliteStore
from llmgw_proto import v1
from llmgw_testkit import free_port, wait_for_async
from llmgw_testkit.servers import Etcd, Postgres

# The etcd and PostgreSQL servers (once per module) are conftest's fixtures.

_prefixes = iter(range(10**6))


def etcd_settings(etcd: Etcd, **extra: Any) -> EtcdSettings:
    return EtcdSettings(endpoints=[etcd.endpoint], prefix=f"/t{next(_prefixes)}", **extra)


# --- records ------------------------------------------------------------------------

CHANGES = [
    Change("node", "gpu-a", b'{"a":1}'),
    Change("replica", "r1", b'{"r":1}'),
    Change("rollout", "m/p", b"anything"),
    Change("replica", "r2", b"x"),
    Change("replica", "r2", None),
]
EXPECTED = {
    "node": {"gpu-a": b'{"a":1}'},
    "replica": {"r1": b'{"r":1}'},
    "rollout": {"m/p": b"anything"},
}


async def roundtrip(make: Any) -> None:
    store = make()
    await store.open()
    await store.write(CHANGES)
    await store.close()
    again = make()
    await again.open()
    assert await again.load() == EXPECTED
    await again.write([Change("node", "gpu-a", None)])
    assert "node" not in await again.load()
    await again.close()


async def test_sqlite_keeps_records_across_opens(tmp_path: Path) -> None:
    await roundtrip(lambda: SqliteStore(tmp_path / "state"))
    assert (tmp_path / "state" / "control.db").exists()


async def test_etcd_keeps_records_across_opens(etcd: Etcd) -> None:
    s = etcd_settings(etcd)
    await roundtrip(lambda: EtcdStore(s))


async def test_postgres_keeps_records_across_opens(postgres: Postgres) -> None:
    await roundtrip(lambda: PostgresStore(PostgresSettings(dsn=postgres.dsn)))
    # Leave the tables empty for the other tests of this module.
    store = PostgresStore(PostgresSettings(dsn=postgres.dsn))
    await store.open()
    await store.conn.execute("DELETE FROM llmgw_records")
    await store.close()


async def test_etcd_writes_larger_than_one_transaction(etcd: Etcd) -> None:
    store = EtcdStore(etcd_settings(etcd))
    await store.open()
    await store.write([Change("node", f"n{i}", b"v") for i in range(450)])
    assert len((await store.load())["node"]) == 450
    await store.close()


# --- stores that cannot be read -----------------------------------------------------


async def test_etcd_records_larger_than_a_request(etcd: Etcd) -> None:
    """etcd takes at most 1.5 MiB per request: a larger record (the endpoints published
    for 10,000 replicas) goes in parts, comes back whole, and its parts go with it."""
    s = etcd_settings(etcd)
    big = bytes(range(256)) * 8000  # 2 MB
    store = EtcdStore(s)
    await store.open()
    try:
        await store.write([Change("publish", "current", big), Change("node", "n", b"x")])
        again = EtcdStore(s)
        await again.open()
        assert await again.load() == {"publish": {"current": big}, "node": {"n": b"x"}}
        await again.write([Change("publish", "current", b"small")])
        parts = await store.client.get_prefix(store.key("parts") + b"/")
        assert list(parts) == [], "no parts left once the record is small again"
        assert (await store.load())["publish"] == {"current": b"small"}
        await store.write([Change("publish", "current", big + b"2")])
        await store.write([Change("publish", "current", None)])
        assert list(await store.client.get_prefix(store.key("parts") + b"/")) == []
        assert "publish" not in await store.load()
        await again.close()
    finally:
        await store.close()


async def test_a_corrupt_sqlite_file_is_refused_by_name(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "control.db").write_bytes(b"this is no database at all" * 200)
    with pytest.raises(StoreError) as err:
        await SqliteStore(state).open()
    text = str(err.value)
    assert str(state / "control.db") in text
    assert "state.state_dir" in text
    assert "cannot be read" in text


async def test_a_foreign_sqlite_file_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    with sqlite3.connect(state / "control.db") as db:
        db.execute("CREATE TABLE other (x)")
    with pytest.raises(StoreError, match="not an llmgw-control state file"):
        await SqliteStore(state).open()


async def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path)
    await store.open()
    await store.close()
    with sqlite3.connect(tmp_path / "control.db") as db:
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    with pytest.raises(StoreError, match="newer llmgw-control"):
        await SqliteStore(tmp_path).open()


async def test_etcd_newer_schema_is_refused(etcd: Etcd) -> None:
    s = etcd_settings(etcd)
    store = EtcdStore(s)
    await store.open()
    await store.client.put(store.key("schema"), str(SCHEMA_VERSION + 1).encode())
    await store.close()
    with pytest.raises(StoreError, match=r"schema version 2, written by a newer"):
        await EtcdStore(s).open()


async def test_etcd_unreachable_names_the_setting() -> None:
    port = free_port()
    store = EtcdStore(EtcdSettings(endpoints=[f"127.0.0.1:{port}"], timeout=1.0))  # type: ignore[arg-type]
    with pytest.raises(StoreError) as err:
        await store.open()
    assert "state.etcd.endpoints" in str(err.value)
    assert f"127.0.0.1:{port}" in str(err.value)
    assert "cannot be reached" in str(err.value)


async def test_postgres_wrong_password_names_the_setting(postgres: Postgres) -> None:
    store = PostgresStore(PostgresSettings(dsn=postgres.dsn_with("wrong")))
    with pytest.raises(StoreError) as err:
        await store.open()
    text = str(err.value)
    assert "refused the password" in text
    assert "state.postgres.dsn" in text
    assert "wrong" not in text, "the password is not shown"


def a_record(records: dict[str, dict[str, bytes]], kind: str) -> bytes:
    return next(iter(records[kind].values()))


def test_a_damaged_record_is_an_error_not_a_fresh_start() -> None:
    with pytest.raises(StoreError, match="a record cannot be read"):
        decode_state({"replica": {"r": b"{not json"}}, Clock.now(), "sqlite store x")


# --- what the control plane writes comes back ---------------------------------------

names = st.text("abcdefgh-.0123", min_size=1, max_size=12)
shard_plans = st.builds(
    ShardPlan,
    names,
    names,
    st.integers(0, 7),
    st.lists(st.integers(0, 7), max_size=8).map(tuple),
    st.integers(1, 65535),
    st.sampled_from(["127.0.0.1", "10.0.0.5", "::1"]),
)
replicas = st.builds(
    Replica,
    names,
    names,
    names,
    size=st.integers(1, 4),
    shards=st.lists(shard_plans, max_size=3),
    attempt=st.integers(0, 9),
    failures=st.integers(0, 9),
    adopted=st.booleans(),
    draining=st.booleans(),
    created_at=st.floats(0, 1e6),
    ready_since=st.none() | st.floats(0, 1e6),
    revision=st.sampled_from(["", "3f2a9c", "b71e04"]),
    slot=st.integers(-1, 9),
)


@settings(max_examples=60, deadline=None)
@given(replicas)
def test_replicas_come_back_as_they_were(r: Replica) -> None:
    clock = Clock(mono=1000.0, wall=1_800_000_000.0)
    raw = encode_replica(r, clock)
    back = decode_state({"replica": {r.replica_id: raw}}, clock, "x").replicas[r.replica_id]
    # Session fields are per stream: a restored plan has not been sent anywhere yet.
    assert encode_replica(back, clock) == raw
    assert [p.start_session for p in back.shards] == [""] * len(r.shards)
    # The revision says which side of a rollout the replica is on.
    assert back.revision == r.revision
    # The slot: a replacement started after a restart still takes it (slots.py).
    assert back.slot == r.slot


def test_a_restored_node_is_unreachable_as_if_just_dropped() -> None:
    node = Node(
        "gpu-a",
        "sess",
        labels={"fabric.nvlink-domain": "d1"},
        gpus=(GpuSlot(0, "H200", 141 * 2**30),),
        interfaces={"lo": ["127.0.0.1/8"]},
        peer_host="127.0.0.1",
        last_seen=10.0,
    )
    node.shards["s1"] = ShardReport(
        "s1", "r1", v1.ShardState.READY, port=21000, gpu_indices=(0,), pid=7
    )
    node.shards["s2"] = ShardReport("s2", "r2", v1.ShardState.STOPPED)
    then = Clock(mono=10.0, wall=1_800_000_000.0)
    raw = encode_node(node, then)
    # Restored an hour later, the node counts as seen now: LOST only after lost_after.
    later = Clock(mono=5000.0, wall=1_800_003_600.0)
    back = decode_state({"node": {"gpu-a": raw}}, later, "x").nodes["gpu-a"]
    assert back.state == NodeState.UNREACHABLE
    assert not back.connected
    assert back.last_seen == 5000.0
    assert back.labels == node.labels
    assert back.gpus == node.gpus
    assert list(back.shards) == ["s1"], "only running shards hold GPUs and ports"
    assert back.shards["s1"].port == 21000
    assert back.shards["s1"].pid == 7


# --- `llmgw-control serve` refuses what it cannot read --------------------------------


def serve(tmp_path: Path, state: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "control.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "listen": f"127.0.0.1:{free_port()}",
                "admin_listen": f"127.0.0.1:{free_port()}",
                "tls": {"insecure": True},
                "state": state,
            }
        )
    )
    return subprocess.run(
        [sys.executable, "-m", "llmgw_control", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_serve_stops_on_a_corrupt_sqlite_file(tmp_path: Path) -> None:
    (tmp_path / "st").mkdir()
    (tmp_path / "st" / "control.db").write_bytes(b"\x00garbage" * 1000)
    done = serve(tmp_path, {"state_dir": "st"})
    assert done.returncode == 2, done.stderr
    assert "control.db" in done.stderr
    assert "state.state_dir" in done.stderr
    assert "Traceback" not in done.stderr
    assert (tmp_path / "st" / "control.db").read_bytes() == b"\x00garbage" * 1000, "left as found"


def test_serve_stops_when_etcd_is_unreachable(tmp_path: Path) -> None:
    port = free_port()
    done = serve(
        tmp_path, {"backend": "etcd", "etcd": {"endpoints": [f"127.0.0.1:{port}"], "timeout": "1s"}}
    )
    assert done.returncode == 2, done.stderr
    assert "state.etcd.endpoints" in done.stderr
    assert "cannot be reached" in done.stderr
    assert "Traceback" not in done.stderr


def test_serve_stops_on_a_wrong_postgres_password(tmp_path: Path, postgres: Postgres) -> None:
    done = serve(tmp_path, {"backend": "postgres", "postgres": {"dsn": postgres.dsn_with("nope")}})
    assert done.returncode == 2, done.stderr
    assert "state.postgres.dsn" in done.stderr
    assert "refused the password" in done.stderr
    assert "Traceback" not in done.stderr


def test_ha_needs_its_backend_as_the_state_backend(tmp_path: Path) -> None:
    config = tmp_path / "control.yaml"
    config.write_text(yaml.safe_dump({"tls": {"insecure": True}, "ha": {"backend": "etcd"}}))
    done = subprocess.run(
        [sys.executable, "-m", "llmgw_control", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "$.ha.backend" in done.stderr
    assert "state.backend: etcd" in done.stderr


# --- the batching writer --------------------------------------------------------------


def _async(fn: Any) -> Any:
    async def probe() -> Any:
        return fn()

    return probe


class MemoryStore:
    """A store in memory that can be told to fail; counts what it was asked to write."""

    description = "memory store"

    def __init__(self) -> None:
        self.records: dict[tuple[str, str], bytes] = {}
        self.batches: list[list[Change]] = []
        self.fail: StoreError | None = None

    async def open(self) -> None:
        return None

    async def load(self) -> dict[str, dict[str, bytes]]:
        out: dict[str, dict[str, bytes]] = {}
        for (kind, key), value in self.records.items():
            out.setdefault(kind, {})[key] = value
        return out

    async def write(self, changes: Any) -> None:
        if self.fail is not None:
            raise self.fail
        self.batches.append(list(changes))
        for c in changes:
            if c.value is None:
                self.records.pop((c.kind, c.key), None)
            else:
                self.records[(c.kind, c.key)] = c.value

    async def close(self) -> None:
        return None


async def test_persister_batches_skips_unchanged_and_retries() -> None:
    from llmgw_control.store.persist import Persister

    store = MemoryStore()
    p = Persister(store, flush_every=0.01)
    p.seed({"node": {"a": b"1"}})
    p.stage("node", "a", b"1")  # what the store holds already: nothing to write
    assert p.pending == 0
    for i in range(100):
        p.stage("node", "b", str(i).encode())  # only the last one counts
    p.stage("replica", "r", b"x")
    task = asyncio.create_task(p.run())
    try:
        await wait_for_async(_async(lambda: p.pending == 0 and store.batches), what="a batch")
        assert len(store.batches) == 1
        assert store.records == {("node", "b"): b"99", ("replica", "r"): b"x"}
        # A failed write keeps what it held; a newer value staged meanwhile wins.
        store.fail = StoreError("disk full")
        p.stage("node", "b", b"100")
        await asyncio.sleep(0.1)
        p.stage("node", "b", b"101")
        store.fail = None
        await wait_for_async(
            _async(lambda: store.records[("node", "b")] == b"101"), timeout=20, what="retried"
        )
        p.stage("replica", "r", None)
        await wait_for_async(_async(lambda: ("replica", "r") not in store.records), what="delete")
    finally:
        task.cancel()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.none() | st.binary(max_size=3)), max_size=30))
def test_a_batch_writes_the_net_effect(steps: list[tuple[str, bytes | None]]) -> None:
    from llmgw_control.store.base import group

    net = group([Change("k", key, value) for key, value in steps])
    last: dict[str, bytes | None] = {}
    for key, value in steps:
        last[key] = value
    assert {key: v for (_, key), v in net.items()} == last


def test_a_replica_whose_node_has_no_record_waits_for_it_like_any_unreachable_node() -> None:
    """The store kept a replica but not (yet) its node's record when control died: the
    node starts UNREACHABLE, and the replica is neither replaced nor given up."""
    import msgspec
    from llmgw_control.catalog import ModelConfig, build_catalog
    from llmgw_control.reconciler import Settings, reconcile
    from llmgw_control.records import ControlState
    from llmgw_control.store.keeper import known_nodes
    from llmgw_control.store.persist import Restored

    models = msgspec.convert(
        [{"name": "m", "profiles": {"p": {"engine": "vllm", "gpus_per_node": 1, "replicas": 1}}}],
        list[ModelConfig],
    )
    catalog = build_catalog(models, "test")
    plan = ShardPlan("m.p.1-0", "gpu-x", 0, (0,), 21000, "127.0.0.1")
    replica = Replica("m.p.1", "m", "p", shards=[plan], created_at=0.0)
    restored = Restored(replicas={replica.replica_id: replica})
    assert known_nodes(restored, 100.0) == ["gpu-x"]
    node = restored.nodes["gpu-x"]
    assert node.state == NodeState.UNREACHABLE
    assert not node.connected
    assert node.last_seen == 100.0
    assert known_nodes(restored, 100.0) == [], "a node is added once"
    state = ControlState(replicas=dict(restored.replicas))
    decision = reconcile(catalog, restored.nodes, state, 101.0, Settings(startup_grace=0.0))
    assert list(decision.state.replicas) == ["m.p.1"]
    assert decision.state.replaced == {}
    assert decision.commands == [], "nothing started in its place"


def test_a_stored_but_unplaced_replica_takes_the_shard_an_agent_reports() -> None:
    """The store kept a replica from before its placement was written: the shard an agent
    reports for it is adopted into it, not stopped as an orphan."""
    import msgspec
    from llmgw_control.catalog import ModelConfig, build_catalog
    from llmgw_control.reconciler import Settings, reconcile
    from llmgw_control.records import ControlState, Stop
    from llmgw_control.store.keeper import adoptable
    from llmgw_control.store.persist import Restored

    models = msgspec.convert(
        [{"name": "m", "profiles": {"p": {"engine": "vllm", "gpus_per_node": 1, "replicas": 1}}}],
        list[ModelConfig],
    )
    catalog = build_catalog(models, "test")
    restored = Restored(replicas={"m.p.1": Replica("m.p.1", "m", "p", created_at=0.0)})
    assert adoptable(restored) == 1
    node = Node(
        "gpu-a",
        "sess",
        gpus=(GpuSlot(0, "H200", 141 * 2**30),),
        interfaces={"lo": ["127.0.0.1/8"]},
        peer_host="127.0.0.1",
        last_seen=100.0,
    )
    node.shards["m.p.1-0"] = ShardReport(
        "m.p.1-0",
        "m.p.1",
        v1.ShardState.READY,
        model="m",
        profile="p",
        port=21000,
        gpu_indices=(0,),
        pid=7,
        endpoint_url="http://127.0.0.1:21000",
    )
    state = ControlState(replicas=dict(restored.replicas))
    decision = reconcile(catalog, {"gpu-a": node}, state, 101.0, Settings(startup_grace=0.0))
    assert [c for c in decision.commands if isinstance(c, Stop)] == [], "not stopped"
    assert decision.commands == []
    shards = decision.state.replicas["m.p.1"].shards
    assert [(p.shard_id, p.node_id) for p in shards] == [("m.p.1-0", "gpu-a")]
