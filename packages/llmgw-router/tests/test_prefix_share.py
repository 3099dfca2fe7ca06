"""The router's side of SharePrefixes (issue 26, control/prefixes.py): what it reports
(its window's keys, the largest counts first, bounded), what it does with the reply (the
fleet's keys to the balancer), and that a lost session drops them. Over a real grpclib
socket to a stand-in handler."""

from __future__ import annotations

import asyncio
from typing import Any

import grpclib.client
import grpclib.const
import grpclib.exceptions
import grpclib.server
from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_proto.v1 import ModelPrefixes, PrefixKey, PrefixReport, PrefixSet
from llmgw_router.balancing import CacheAware
from llmgw_router.control.prefixes import PrefixSharer, fleet_keys, report_keys
from llmgw_testkit import free_port, wait_for_async
from llmgw_testkit.candidates import Cand, usable


@settings(deadline=None)
@given(
    st.dictionaries(
        st.integers(0, 2**64 - 1),
        st.tuples(st.integers(0, 99), st.integers(1, 99), st.sampled_from(["", "e1"])),
        max_size=30,
    ),
    st.integers(0, 40),
)
def test_a_report_keeps_the_largest_counts(
    keys: dict[int, tuple[int, int, str]], limit: int
) -> None:
    out = report_keys(keys, limit)
    assert len(out) == min(limit, len(keys))
    assert {k.key: (k.size, k.count, k.holder) for k in out}.items() <= keys.items()
    dropped = [c for key, (_, c, _) in keys.items() if key not in {k.key for k in out}]
    if out:
        assert all(c <= min(k.count for k in out) for c in dropped)


def test_the_replys_models_are_merged_into_one_set() -> None:
    reply = PrefixSet(
        models=[
            ModelPrefixes(model="a", keys=[PrefixKey(key=1, size=8, count=2, holder="e1")]),
            ModelPrefixes(model="b", keys=[PrefixKey(key=1, size=0, count=1, holder="e2")]),
            ModelPrefixes(model="b", keys=[PrefixKey(key=2, size=4, count=1)]),
        ]
    )
    assert fleet_keys(reply) == {1: (8, 3, "e1"), 2: (4, 1, "")}


class StandIn:
    """SharePrefixes answering ``fleet`` plus what was reported."""

    def __init__(self, fleet: list[PrefixKey], status: grpclib.const.Status | None = None):
        self.fleet = fleet
        self.status = status
        self.reports: list[PrefixReport] = []

    async def share(self, stream: Any) -> None:
        report = await stream.recv_message()
        self.reports.append(report)
        if self.status is not None:
            raise grpclib.exceptions.GRPCError(self.status, "no")
        keys = [*self.fleet, *(k for m in report.models for k in m.keys)]
        await stream.send_message(PrefixSet(models=[ModelPrefixes(keys=keys)], routers=2))

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            "/llmgw.v1.EndpointService/SharePrefixes": grpclib.const.Handler(
                self.share, grpclib.const.Cardinality.UNARY_UNARY, PrefixReport, PrefixSet
            )
        }


async def test_the_fleets_keys_reach_the_balancer_and_go_with_the_session() -> None:
    balancer = CacheAware[Cand](shared_homes=True)
    ready = [Cand(f"e{i}", cache_blocks=100) for i in range(2)]
    prompt = tuple(range(1, 21))
    balancer.choose(ready, usable, None, prompt, at=0.0)
    stand_in = StandIn([PrefixKey(key=77, size=12, count=5, holder="e1")])
    server = grpclib.server.Server([stand_in])
    port = free_port()
    await server.start("127.0.0.1", port)
    channel = grpclib.client.Channel("127.0.0.1", port)
    sharer = PrefixSharer(balancer, "r1", interval=0.05)
    task = asyncio.create_task(sharer.share(channel))
    try:

        async def shared() -> bool | None:
            return 77 in balancer.fleet_keys() or None

        await wait_for_async(shared, timeout=10, what="the fleet's keys at the balancer")
        report = stand_in.reports[0]
        assert report.router_id == "r1"
        assert [k.key for m in report.models for k in m.keys] == list(balancer.recent_keys())
        assert balancer.fleet_keys()[77] == (12, 5, "e1")
        assert report.models[0].keys[0].holder in ("e0", "e1")
        assert sharer.routers == 2
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        # The session ended: the fleet's keys are not kept.
        assert balancer.fleet_keys() == {}
    finally:
        task.cancel()
        channel.close()
        server.close()
        await server.wait_closed()


async def test_a_control_plane_without_share_prefixes_ends_it_quietly() -> None:
    balancer = CacheAware[Cand](shared_homes=True)
    stand_in = StandIn([], grpclib.const.Status.UNIMPLEMENTED)
    server = grpclib.server.Server([stand_in])
    port = free_port()
    await server.start("127.0.0.1", port)
    channel = grpclib.client.Channel("127.0.0.1", port)
    try:
        await asyncio.wait_for(PrefixSharer(balancer, "r1", interval=0.05).share(channel), 10)
        assert len(stand_in.reports) == 1
        assert balancer.fleet_keys() == {}
    finally:
        channel.close()
        server.close()
        await server.wait_closed()
