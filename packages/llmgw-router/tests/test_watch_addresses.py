"""The watcher's address list: configured addresses, DNS names with several records, and
the leader a standby named (issue 14.2). In-process: no control plane needed."""

from __future__ import annotations

import socket

from llmgw_proto.addr import HostPort
from llmgw_proto.tls import TlsConfig
from llmgw_router.config import ControlConfig, RouterConfig
from llmgw_router.endpoints import EndpointSet
from llmgw_router.metrics import Metrics
from llmgw_router.state import RouterState
from llmgw_router.watch import EndpointWatcher, _leader_from


def watcher(**control: object) -> EndpointWatcher:
    cc = ControlConfig(tls=TlsConfig(insecure=True), **control)  # type: ignore[arg-type]
    state = RouterState(RouterConfig(control=cc), EndpointSet([]), Metrics())
    return EndpointWatcher(state, cc, insecure=True, router_id="r")


async def test_configured_addresses_in_order_and_the_leader_first() -> None:
    w = watcher(address="127.0.0.1:7070", addresses=["127.0.0.2:7071", "[::1]:7072"])
    assert await w._addresses() == [
        ("127.0.0.1", 7070, None),
        ("127.0.0.2", 7071, None),
        ("::1", 7072, None),
    ]
    w.leader = HostPort("127.0.0.2", 7071)
    assert (await w._addresses())[0] == ("127.0.0.2", 7071, None)
    assert len(await w._addresses()) == 3  # no duplicate


async def test_a_name_with_several_records_is_several_instances() -> None:
    records = {
        str(info[4][0]) for info in socket.getaddrinfo("localhost", 7070, type=socket.SOCK_STREAM)
    }
    w = watcher(address="localhost:7070")
    found = await w._addresses()
    if len(records) > 1:
        # Each address is tried; the certificate is checked against the name.
        assert {host for host, _, _ in found} == records
        assert {name for _, _, name in found} == {"localhost"}
    else:
        assert found == [("localhost", 7070, None)]


def test_leader_metadata() -> None:
    assert _leader_from({"llmgw-leader": "10.0.0.2:7070"}) == HostPort("10.0.0.2", 7070)
    assert _leader_from({"llmgw-leader": "[fd00::2]:7070"}) == HostPort("fd00::2", 7070)
    assert _leader_from({"llmgw-leader": "nonsense"}) is None
    assert _leader_from({}) is None
    assert _leader_from(None) is None
