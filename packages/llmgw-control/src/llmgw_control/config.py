"""control.yaml: where the control plane listens, its timings, and the catalog.

```yaml
listen: 0.0.0.0:7070          # AgentService and EndpointService, one gRPC server
admin_listen: 127.0.0.1:9091  # /metrics /healthz /v1/status /v1/explain/{model}
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
from typing import Annotated

import msgspec
from llmgw_proto.addr import HostPort, parse_hostport
from llmgw_proto.config import BaseConfig, ConfigError, Duration, load
from llmgw_proto.tls import TlsConfig

from llmgw_control.catalog import Catalog, ModelConfig, build_catalog

__all__ = [
    "ControlConfig",
    "ControlSettings",
    "Loaded",
    "TlsConfig",
    "load_control_config",
    "split_hostport",
]

Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]


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
    # Engine grace between SIGTERM and SIGKILL on StopShard.
    stop_grace: Duration = Duration(30.0)
    # How long an agent has to answer a command with a CommandResult.
    command_timeout: Duration = Duration(30.0)


class ControlConfig(BaseConfig):
    listen: str = "0.0.0.0:7070"
    admin_listen: str = "127.0.0.1:9091"
    tls: TlsConfig = msgspec.field(default_factory=TlsConfig)
    control: ControlSettings = msgspec.field(default_factory=ControlSettings)
    models: list[ModelConfig] = []


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
    if c.interval <= 0:
        raise ConfigError(source, "interval must be > 0", "$.control.interval")
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
    return build_catalog(config.models, source)


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
