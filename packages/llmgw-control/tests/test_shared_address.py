"""Issue 13.1 with processes: two agents behind one address, one 2-node replica.

Both fake agents dial from 127.0.0.1 and report 127.0.0.1 on their management
interface, as agents on one host (or behind one NAT address) do. The two shards and
the leader's rendezvous port must all differ, and a second replica placed later
must not reuse any of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmgw_testkit import wait_for_async

Factory = Callable[..., Any]


async def test_shards_behind_one_address_get_distinct_ports(
    control_factory: Factory, agent_factory: Factory
) -> None:
    profile = {"engine": "sglang", "gpus_per_node": 1, "nodes": 2, "replicas": 2}
    control = control_factory([{"name": "big", "profiles": {"p": profile}}])
    a = agent_factory(control.grpc_port, "host-a", gpus=2)
    b = agent_factory(control.grpc_port, "host-b", gpus=2)
    a.start()
    b.start()

    async def four_starts() -> Any:
        starts = a.starts() + b.starts()
        return starts if len(starts) == 4 else None

    starts = await wait_for_async(four_starts, timeout=30, interval=0.05, what="four shards")
    ports = [s.port for s in starts]
    rendezvous = [
        int(s.multi_node.leader_address.rsplit(":", 1)[1]) for s in starts if s.multi_node.rank == 0
    ]
    assert len(rendezvous) == 2
    taken = ports + rendezvous
    # Ports belong to the one address both nodes share: every one of them differs.
    assert len(set(taken)) == len(taken), sorted(taken)
    status = await control.until(
        lambda s: len([r for r in s["replicas"] if r["state"] == "ready"]) == 2 and s,
        "both replicas ready",
    )
    for replica in status["replicas"]:
        assert sorted(replica["nodes"]) == ["host-a", "host-b"]
