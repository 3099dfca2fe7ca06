"""control.yaml: where the control plane listens, its timings, and the catalog.

```yaml
listen: 0.0.0.0:7070          # AgentService and EndpointService, one gRPC server
admin_listen: 127.0.0.1:9091  # /metrics /healthz /v1/status /v1/explain/{model}
max_message_bytes: 4194304    # the largest gRPC message read (4 MiB)
tls: {insecure: false, cert: control.crt, key: control.key, ca: ca.crt}
control:
  interval: 5s
  ...
models:
  - name: llama-3-8b
    profiles:
      default: {engine: vllm, gpus_per_node: 1, replicas: 2}
```
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from llmgw_proto.addr import HostPort, parse_hostport
from llmgw_proto.config import BaseConfig, ConfigError, Duration, load
from llmgw_proto.tls import TlsConfig
from llmgw_proto.tracing import TracingConfig
from llmgw_proto.tracing import check_config as check_tracing

from llmgw_control.auth import AdminAuth
from llmgw_control.catalog import Catalog, ModelConfig, build_catalog

__all__ = [
    "ControlConfig",
    "ControlSettings",
    "EtcdSettings",
    "HaSettings",
    "Loaded",
    "PostgresSettings",
    "StateSettings",
    "TlsConfig",
    "load_control_config",
    "split_hostport",
]

Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
# gRPC messages received: gRPC's usual 4 MiB by default; from 64 KiB to 1 GiB.
MessageBytes = Annotated[int, msgspec.Meta(ge=64 * 1024, le=1024 * 1024 * 1024)]


class ControlSettings(BaseConfig):
    # The reconciler runs on every event and at least this often.
    interval: Duration = Duration(5.0)
    # Per-replica retry delay after a failure: base * 2**failures, capped.
    base_backoff: Duration = Duration(5.0)
    max_backoff: Duration = Duration(300.0)
    # A node without a heartbeat (or stream) this long is UNREACHABLE, then LOST.
    unreachable_after: Duration = Duration(15.0)
    lost_after: Duration = Duration(120.0)
    # After a start, wait this long for agents to reconnect and report their shards
    # before placing new replicas, so a restart adopts instead of double-starting.
    startup_grace: Duration = Duration(10.0)
    # The interface whose first address is a node's endpoint address; "" = peer address.
    mgmt_interface: str = ""
    port_range: tuple[Port, Port] = (20000, 29999)
    heartbeat_interval: Duration = Duration(2.0)
    drain_timeout: Duration = Duration(120.0)
    # A serving replica llmgw takes away (scale-down, rolling update, node drain, restart)
    # is published leaving this long before its drain: routers warm the replicas that
    # inherit its hot prefixes (issue 28). 0: drained at once.
    warm_before_drain: Duration = Duration(2.0)
    # Engine grace between SIGTERM and SIGKILL on StopShard.
    stop_grace: Duration = Duration(30.0)
    # How long an agent has to answer a command with a CommandResult.
    command_timeout: Duration = Duration(30.0)
    # How often agents read their engines' metrics for load reports (RegisterAck).
    load_interval: Duration = Duration(0.25)


class EtcdSettings(BaseConfig):
    # host:port of etcd's client endpoints (v3 API); the first that answers is used.
    endpoints: list[str] = msgspec.field(default_factory=lambda: ["127.0.0.1:2379"])
    # Every key of this control plane lives under this prefix.
    prefix: str = "/llmgw"
    username: str = ""
    password: str = ""
    # How long to wait for etcd at start and per request.
    timeout: Duration = Duration(5.0)


class PostgresSettings(BaseConfig):
    # libpq-style URL: postgresql://user:password@host:port/dbname
    dsn: str = ""
    # A password kept out of the DSN (e.g. from a secrets file written at deploy time).
    password_file: str = ""
    timeout: Duration = Duration(5.0)


class StateSettings(BaseConfig):
    """Where the control plane keeps what it must not forget (nodes, replicas, endpoints)."""

    backend: Literal["sqlite", "etcd", "postgres"] = "sqlite"
    # sqlite: the directory of control.db; relative paths are from the config file.
    state_dir: str = "control-state"
    etcd: EtcdSettings = msgspec.field(default_factory=EtcdSettings)
    postgres: PostgresSettings = msgspec.field(default_factory=PostgresSettings)


class HaSettings(BaseConfig):
    """Several instances, one leader; the state lives in the backend named here."""

    backend: Literal["etcd", "postgres"]
    # Unique per instance; default: hostname and listen port.
    instance_id: str = ""
    # host:port agents and routers dial to reach this instance (told them by standbys).
    advertise: str = ""
    # A leader that cannot renew its lease (or verify its lock) for this long steps down.
    lease_ttl: Duration = Duration(10.0)


class ControlConfig(BaseConfig):
    listen: str = "0.0.0.0:7070"
    admin_listen: str = "127.0.0.1:9091"
    # Who may change the fleet through the admin API (llmgw_control.auth).
    admin_auth: AdminAuth = msgspec.field(default_factory=AdminAuth)
    # The largest gRPC message the control plane reads (AgentService, EndpointService):
    # a larger one is refused with RESOURCE_EXHAUSTED from its length prefix, unread.
    max_message_bytes: MessageBytes = 4 * 1024 * 1024
    tls: TlsConfig = msgspec.field(default_factory=TlsConfig)
    control: ControlSettings = msgspec.field(default_factory=ControlSettings)
    models: list[ModelConfig] = []
    state: StateSettings = msgspec.field(default_factory=StateSettings)
    ha: HaSettings | None = None
    # OpenTelemetry spans of placements and starts over OTLP/HTTP (llmgw_proto.tracing);
    # off unless an endpoint is set.
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)


@dataclass(frozen=True)
class Loaded:
    config: ControlConfig
    catalog: Catalog


def split_hostport(value: str) -> HostPort:
    """A listen address, by llmgw_proto.addr's one grammar; an empty host listens on all."""
    return parse_hostport(value, default_host="0.0.0.0")


def check(config: ControlConfig, source: str) -> Catalog:
    """Cross-field checks of the whole file; the catalog checks its own part."""
    for field in ("listen", "admin_listen"):
        try:
            split_hostport(getattr(config, field))
        except ValueError as err:
            raise ConfigError(source, str(err), f"$.{field}") from None
    c = config.control
    lo, hi = c.port_range
    if lo > hi:
        raise ConfigError(
            source, f"port range {lo}-{hi} is empty: write [low, high]", "$.control.port_range"
        )
    check_tracing(config.tracing, source)
    if c.interval <= 0:
        raise ConfigError(source, "interval must be > 0", "$.control.interval")
    if c.load_interval <= 0:
        raise ConfigError(source, "load_interval must be > 0", "$.control.load_interval")
    if c.heartbeat_interval <= 0:
        raise ConfigError(source, "heartbeat_interval must be > 0", "$.control.heartbeat_interval")
    if c.base_backoff <= 0 or c.max_backoff < c.base_backoff:
        raise ConfigError(source, "need 0 < base_backoff <= max_backoff", "$.control.max_backoff")
    if c.unreachable_after <= c.heartbeat_interval:
        raise ConfigError(
            source,
            f"unreachable_after ({c.unreachable_after:g}s) must be longer than "
            f"heartbeat_interval ({c.heartbeat_interval:g}s)",
            "$.control.unreachable_after",
        )
    if c.lost_after <= c.unreachable_after:
        raise ConfigError(
            source,
            f"lost_after ({c.lost_after:g}s) must be longer than unreachable_after "
            f"({c.unreachable_after:g}s)",
            "$.control.lost_after",
        )
    check_state(config, source)
    return build_catalog(config.models, source)


def check_state(config: ControlConfig, source: str) -> None:
    """state: and ha: agree with each other and name what they need."""
    st = config.state
    if st.backend == "sqlite" and not st.state_dir:
        raise ConfigError(source, "state_dir must not be empty", "$.state.state_dir")
    if st.backend == "etcd":
        if not st.etcd.endpoints:
            raise ConfigError(
                source, "at least one etcd endpoint is needed", "$.state.etcd.endpoints"
            )
        for i, ep in enumerate(st.etcd.endpoints):
            try:
                split_hostport(ep.split("://", 1)[-1])
            except ValueError as err:
                raise ConfigError(source, str(err), f"$.state.etcd.endpoints[{i}]") from None
        if not st.etcd.prefix.startswith("/"):
            raise ConfigError(source, "prefix must start with /", "$.state.etcd.prefix")
    if st.backend == "postgres" and not st.postgres.dsn:
        raise ConfigError(
            source,
            "dsn is required with backend postgres (postgresql://user@host:port/db)",
            "$.state.postgres.dsn",
        )
    ha = config.ha
    if ha is None:
        return
    if ha.backend != st.backend:
        raise ConfigError(
            source,
            f"ha.backend {ha.backend} needs state.backend: {ha.backend} (the leader's lease "
            f"and the state live in one store), not {st.backend}",
            "$.ha.backend",
        )
    if ha.lease_ttl < 1:
        raise ConfigError(source, "lease_ttl must be at least 1s", "$.ha.lease_ttl")
    if ha.advertise:
        try:
            split_hostport(ha.advertise)
        except ValueError as err:
            raise ConfigError(source, str(err), "$.ha.advertise") from None


def load_control_config(path: str | Path) -> Loaded:
    """Read, validate and build the catalog; any problem is a located ConfigError."""
    config = load(path, ControlConfig)
    return Loaded(config, check(config, str(path)))


def tls_problem(config: ControlConfig, insecure_flag: bool, source: str) -> ConfigError | None:
    """llmgw_proto.tls's one rule: plaintext asked for, or cert, key and ca given and present."""
    try:
        config.tls.with_insecure_flag(insecure_flag).check(source, "$.tls")
    except ConfigError as err:
        return err
    return None
