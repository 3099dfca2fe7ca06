"""The watcher's address list: configured addresses, DNS names with several records, and
the leader a standby named (issue 14.2). In-process: no control plane needed."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from llmgw_proto.addr import HostPort
from llmgw_proto.config import ConfigError, load
from llmgw_proto.tls import TlsConfig
from llmgw_router.config import ControlConfig, RouterConfig, validate
from llmgw_router.control.watch import EndpointWatcher, _leader_from
from llmgw_router.endpoints import EndpointSet
from llmgw_router.metrics import Metrics
from llmgw_router.state import RouterState


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


async def test_keepalive_settings_are_checked_and_named(tmp_path: Path) -> None:
    """Issue 24 point 11: the control connection's pings are configurable; a value
    grpclib would refuse is named in the config error."""
    for field in ("keepalive", "keepalive_timeout"):
        path = tmp_path / f"{field}.yaml"
        path.write_text(
            "control: {address: 127.0.0.1:7070, tls: {insecure: true}, " + field + ": 0s}\n"
        )
        with pytest.raises(ConfigError) as err:
            validate(load(path, RouterConfig), str(path))
        assert f"$.control.{field}" in str(err.value)
        assert "must be >= 10ms" in str(err.value)
    w = watcher(address="127.0.0.1:7070", keepalive=0.5, keepalive_timeout=1.5)
    channel = w._channel("127.0.0.1", 7070, None)
    config = channel._config
    channel.close()
    assert config._keepalive_time == 0.5
    assert config._keepalive_timeout == 1.5
    assert config._http2_max_pings_without_data == 0
