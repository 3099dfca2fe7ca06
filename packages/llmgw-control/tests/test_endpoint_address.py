"""Issue 12.6: the agent owns the endpoint address; control publishes it and warns loudly.

The control plane publishes exactly the URL the agent reported for its engine. When that
URL cannot be right for routers (a loopback URL from a node whose stream comes from
elsewhere, or an address the node does not have), it says so in status and the log.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from llmgw_control.publish import address_problem, engine_generation
from llmgw_proto import v1

Factory = Callable[..., Any]
S = v1.ShardState


def test_address_problems() -> None:
    lo = {"lo": ["127.0.0.1/8"], "eth0": ["10.0.0.5/24", "fe80::1/64"]}
    assert address_problem("http://10.0.0.5:20000", "10.0.0.5", lo) is None
    assert address_problem("http://127.0.0.1:20000", "127.0.0.1", lo) is None
    assert address_problem("http://gpu-a.internal:20000", "10.0.0.5", lo) is None
    # Behind NAT: the stream's address is the published one.
    assert address_problem("http://203.0.113.7:20000", "203.0.113.7", {}) is None
    loopback = address_problem("http://127.0.0.1:20000", "10.0.0.5", lo)
    assert loopback is not None
    assert "loopback" in loopback
    assert "10.0.0.5" in loopback
    elsewhere = address_problem("http://10.9.9.9:20000", "10.0.0.5", lo)
    assert elsewhere is not None
    assert "10.9.9.9 is not an address of the node" in elsewhere
    assert address_problem("http://[fe80::1]:20000", "10.0.0.5", lo) is None
    missing = address_problem("", "10.0.0.5", lo)
    assert missing is not None
    assert "no endpoint URL" in missing


@given(st.text(max_size=20), st.integers(0, 2**22), st.text(max_size=20), st.integers(0, 2**22))
def test_generation_changes_with_the_engine_process(
    shard: str, pid: int, other_shard: str, other_pid: int
) -> None:
    g = engine_generation(shard, pid)
    assert g == engine_generation(shard, pid)  # the same after a control-plane restart
    assert 0 < g < 2**63 or g == 0
    if (shard, pid) != (other_shard, other_pid):
        # 63 bits of a cryptographic hash: a collision here would be news.
        assert g != engine_generation(other_shard, other_pid)


async def test_the_agents_url_is_published_and_a_wrong_one_is_reported(
    control_factory: Factory, agent_factory: Factory, watcher_factory: Factory
) -> None:
    control = control_factory([{"name": "m", "profiles": {"p": {"engine": "vllm"}}}])
    agent = agent_factory(control.grpc_port, "gpu-a")
    # An agent advertising an address it does not have (its interfaces: lo 127.0.0.1).
    agent.running["m.p.0000abcd-0"] = v1.RunningShard(
        shard_id="m.p.0000abcd-0", replica_id="m.p.0000abcd", model="m", profile="p",
        state=S.READY, endpoint_url="http://10.9.9.9:21042", gpu_indices=[0], port=21042,
        pid=4242, rank=0, world_size=1,
    )  # fmt: skip
    agent.start()
    snap = await watcher_factory(control.grpc_port).until(
        lambda s: len(s.endpoints) == 1, "the adopted endpoint"
    )
    # Exactly what the agent said: control does not substitute an address of its own.
    assert snap.endpoints[0].url == "http://10.9.9.9:21042"
    status = await control.until(lambda s: s["warnings"] and s, "the warning in status")
    (warning,) = status["warnings"]
    assert warning["replica_id"] == "m.p.0000abcd"
    assert "10.9.9.9 is not an address of the node" in warning["warning"]
    (replica,) = status["replicas"]
    assert replica["endpoint_warning"] == warning["warning"]
    assert replica["endpoint"] == "http://10.9.9.9:21042"
    assert control.proc is not None
    control.proc.wait_output("endpoint address unreachable")
    await control.passes(5)
    records = [json.loads(x) for x in control.proc.output().splitlines() if x.startswith("{")]
    logged = [r for r in records if r.get("event") == "endpoint address unreachable"]
    assert len(logged) == 1  # once, not on every pass
    assert logged[0]["level"] == "warning"
