"""Only the leader serves keys: a standby refuses WatchKeys, ReportUsage and key changes
with where to go, and a lost lead ends the key watches (real grpclib sockets)."""

from __future__ import annotations

import asyncio

import grpclib.client
import grpclib.const
import grpclib.server
import msgspec
import pytest
from grpclib.exceptions import GRPCError
from llmgw_control.keys_admin import KeysApi
from llmgw_control.leader_gate import LeaderGate
from llmgw_control.tenants import Tenants
from llmgw_proto import v1
from llmgw_testkit import free_port, wait_for_async

LEADER = "127.0.0.1:7171"


async def serve(gate: LeaderGate) -> tuple[grpclib.server.Server, grpclib.client.Channel]:
    server = grpclib.server.Server([gate])
    port = free_port()
    await server.start("127.0.0.1", port)
    return server, grpclib.client.Channel("127.0.0.1", port)


async def test_a_standby_refuses_keys_and_usage_with_the_leaders_address() -> None:
    tenants = Tenants()
    tenants.create("k", {"rpm": 5})
    server, channel = await serve(LeaderGate([tenants], lambda: False, lambda: LEADER))
    try:
        stub = v1.EndpointServiceStub(channel)
        for call in (
            lambda: anext(aiter(stub.watch_keys(v1.WatchRequest(router_id="r")))),
            lambda: stub.report_usage(v1.UsageReport(router_id="r", instance="i", sequence=1)),
        ):
            with pytest.raises(GRPCError) as err:
                await call()
            assert err.value.status == grpclib.const.Status.UNAVAILABLE
            assert f"the leader is {LEADER}" in str(err.value.message)
    finally:
        channel.close()
        server.close()
        await server.wait_closed()


async def test_a_lost_lead_ends_the_key_watch() -> None:
    leading = True
    tenants = Tenants()
    tenants.create("k", {"rpm": 5})
    gate = LeaderGate([tenants], lambda: leading, lambda: LEADER)
    server, channel = await serve(gate)
    received: list[v1.KeySet] = []
    ended: list[BaseException] = []

    async def watch() -> None:
        try:
            stub = v1.EndpointServiceStub(channel)
            async for key_set in stub.watch_keys(v1.WatchRequest(router_id="r")):
                received.append(key_set)
        except GRPCError as err:
            ended.append(err)

    task = asyncio.create_task(watch())
    try:

        async def got(n: int) -> bool | None:
            return len(received) >= n or None

        await wait_for_async(lambda: got(1), timeout=10, what="the key set")
        assert [k.name for k in received[0].keys] == ["k"]
        tenants.revoke("k")
        await wait_for_async(lambda: got(2), timeout=10, what="the revocation")
        assert received[1].keys[0].revoked
        assert received[1].version > received[0].version
        leading = False
        gate.end_all("the lead was lost")

        async def done() -> bool | None:
            return bool(ended) or None

        await wait_for_async(done, timeout=10, what="the watch ended")
        assert isinstance(ended[0], GRPCError)
        assert ended[0].status == grpclib.const.Status.UNAVAILABLE
    finally:
        task.cancel()
        channel.close()
        server.close()
        await server.wait_closed()


async def test_a_standby_refuses_key_changes_through_the_admin_api() -> None:
    tenants = Tenants(leading=lambda: False)
    api = KeysApi(tenants)
    answer = await api("POST", "/v1/keys", b'{"name": "k"}')
    assert answer is not None
    code, _, body = answer
    assert code == 503
    assert "stands by" in msgspec.json.decode(body)["error"]
    assert tenants.keys == {}
    assert await api("GET", "/v1/status", b"") is None
