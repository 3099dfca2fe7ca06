"""Issue 24.3: each engine's secret, from its agent's statuses to what routers are sent.

It reaches routers in the published Endpoint and survives a control-plane restart (the
store) and a re-registration (Register's RunningShard); it is shown nowhere.
"""

from __future__ import annotations

import os
import stat
import string
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from llmgw_control.inventory import Inventory, Node, ShardReport
from llmgw_control.publish import EndpointInfo
from llmgw_control.store.base import Change
from llmgw_control.store.persist import Clock, decode_state, encode_node
from llmgw_control.store.sqlite import SqliteStore
from llmgw_proto import v1

S = v1.ShardState
KEY = "engine-s3cr3t"


def test_ready_names_the_secret_and_later_states_keep_it() -> None:
    inventory = Inventory()
    inventory.register(v1.Register(node_id="gpu-a"), "s1", "127.0.0.1", now=0.0)
    status = v1.ShardStatus(shard_id="r-0", replica_id="r", state=S.STARTING, pid=7)
    inventory.shard_status("gpu-a", "s1", status, now=1.0)
    assert inventory.nodes["gpu-a"].shards["r-0"].api_key == ""
    ready = v1.ShardStatus(shard_id="r-0", replica_id="r", state=S.READY, api_key=KEY)
    inventory.shard_status("gpu-a", "s1", ready, now=2.0)
    draining = v1.ShardStatus(shard_id="r-0", replica_id="r", state=S.DRAINING)
    inventory.shard_status("gpu-a", "s1", draining, now=3.0)
    report = inventory.nodes["gpu-a"].shards["r-0"]
    assert report.api_key == KEY
    assert KEY not in repr(report)


def test_a_re_registering_agent_brings_the_secret_back() -> None:
    inventory = Inventory()
    shard = v1.RunningShard(shard_id="r-0", replica_id="r", state=S.READY, api_key=KEY)
    inventory.register(v1.Register(node_id="gpu-a", shards=[shard]), "s2", "127.0.0.1", now=0.0)
    assert inventory.nodes["gpu-a"].shards["r-0"].api_key == KEY


def test_the_store_keeps_the_secret_across_a_restart() -> None:
    node = Node("gpu-a", "sess", peer_host="127.0.0.1", last_seen=10.0)
    node.shards["r-0"] = ShardReport("r-0", "r", S.READY, port=21000, pid=7, api_key=KEY)
    raw = encode_node(node, Clock(mono=10.0, wall=1_800_000_000.0))
    back = decode_state({"node": {"gpu-a": raw}}, Clock(mono=20.0, wall=1_800_000_010.0), "x")
    assert back.nodes["gpu-a"].shards["r-0"].api_key == KEY


def _info(api_key: str) -> EndpointInfo:
    return EndpointInfo(
        id="r",
        url="http://10.0.0.5:21000",
        served_model_names=("m",),
        model="m",
        profile="p",
        weight=1,
        node_id="gpu-a",
        labels=(),
        replica_id="r",
        health_path="/health",
        api_key=api_key,
    )


# Secrets like the agent's (hex now; any URL-safe text here): long enough to be in no other field.
@given(st.text(alphabet=string.ascii_letters + string.digits + "-_", min_size=16, max_size=43))
def test_routers_get_the_secret_and_logs_never_see_it(key: str) -> None:
    info = _info(key)
    assert info.message().api_key == key
    assert key not in repr(info)
    # A new secret (a new engine behind the same replica) is a change to publish.
    assert info != _info(key + "x")


async def test_the_sqlite_state_is_the_owners_alone(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    # A file an older build left world-readable is tightened too.
    (state / "control.db").touch(mode=0o644)
    old = os.umask(0o022)
    try:
        store = SqliteStore(state)
        await store.open()
        await store.write([Change("node", "gpu-a", b'{"api_key": "x"}')])
        await store.close()
    finally:
        os.umask(old)
    files = [p for p in state.iterdir() if p.name.startswith("control.db")]
    assert files
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path.name
