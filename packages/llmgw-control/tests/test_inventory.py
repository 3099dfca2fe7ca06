"""Node records: what registration and shard statuses leave in the inventory."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from llmgw_control.inventory import Inventory, NodeState, node_state
from llmgw_proto import v1

S = v1.ShardState


def test_a_status_only_shard_keeps_its_port_and_gpus_reserved() -> None:
    inventory = Inventory()
    inventory.register(v1.Register(node_id="gpu-a"), "s1", "127.0.0.1", now=0.0)
    inventory.shard_status(
        "gpu-a",
        "s1",
        v1.ShardStatus(
            shard_id="r-0", replica_id="r", state=S.STARTING, pid=7, port=21000, gpu_indices=[2, 3]
        ),
        now=1.0,
    )
    # A later status without them (an older agent, say) does not forget them.
    inventory.shard_status("gpu-a", "s1", v1.ShardStatus(shard_id="r-0", state=S.READY), now=2.0)
    report = inventory.nodes["gpu-a"].shards["r-0"]
    assert (report.port, report.gpu_indices, report.pid, report.running) == (21000, (2, 3), 7, True)


def test_statuses_from_a_replaced_stream_are_ignored() -> None:
    inventory = Inventory()
    inventory.register(v1.Register(node_id="gpu-a"), "old", "127.0.0.1", now=0.0)
    inventory.register(v1.Register(node_id="gpu-a"), "new", "127.0.0.1", now=1.0)
    inventory.shard_status("gpu-a", "old", v1.ShardStatus(shard_id="x", state=S.READY), now=2.0)
    assert inventory.nodes["gpu-a"].shards == {}


@given(
    connected=st.booleans(),
    silent=st.floats(0, 1000),
    unreachable=st.floats(0.1, 100),
    extra=st.floats(0.1, 100),
)
def test_node_state_follows_silence(
    connected: bool, silent: float, unreachable: float, extra: float
) -> None:
    lost = unreachable + extra
    state = node_state(connected, 0.0, silent, unreachable, lost)
    if silent >= lost:
        assert state == NodeState.LOST
    elif connected and silent < unreachable:
        assert state == NodeState.READY
    else:
        assert state in (NodeState.UNREACHABLE, NodeState.READY)
        if silent >= unreachable:
            assert state == NodeState.UNREACHABLE
