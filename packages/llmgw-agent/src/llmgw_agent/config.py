"""agent.yaml: what one GPU node's agent is told.

Everything has a default except what only the operator can know (labels, the
control plane's address in production). Problems are reported by
:func:`llmgw_proto.config.load` as ``agent.yaml: $.field: message``.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Annotated

import msgspec
from llmgw_proto.addr import parse_hostport
from llmgw_proto.config import BaseConfig, ConfigError, Duration, convert, read
from llmgw_proto.keepalive import keepalive_problem
from llmgw_proto.sizes import parse_size
from llmgw_proto.tls import TlsConfig
from llmgw_proto.tracing import TracingConfig, check_config

__all__ = [
    "AgentConfig",
    "ControlConfig",
    "EngineCommand",
    "EnginesConfig",
    "SimulatedGpus",
    "TlsConfig",
    "load_agent_config",
    "parse_size",  # re-exported from llmgw_proto.sizes
]

NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]
Command = Annotated[list[NonEmptyStr], msgspec.Meta(min_length=1)]


class ControlConfig(BaseConfig):
    address: NonEmptyStr = "127.0.0.1:7070"
    # Several control-plane instances (high availability): tried in turn, and a standby's
    # answer names the leader. Empty: just ``address`` (a DNS name may resolve to several).
    addresses: list[NonEmptyStr] = msgspec.field(default_factory=list)
    tls: TlsConfig = msgspec.field(default_factory=TlsConfig)
    # How long to wait for RegisterAck before giving up on a connection attempt.
    register_timeout: Duration = Duration(30.0)
    # An HTTP/2 ping every `keepalive`; one unanswered for `keepalive_timeout` gives the
    # stream up (a control plane frozen or gone without closing the connection), and
    # the next control plane is tried.
    keepalive: Duration = Duration(10.0)
    keepalive_timeout: Duration = Duration(20.0)


class SimulatedGpus(BaseConfig):
    count: Annotated[int, msgspec.Meta(ge=0, le=64)]
    name: NonEmptyStr = "NVIDIA H100 80GB HBM3"
    memory: str | int = "80GiB"


class EngineCommand(BaseConfig):
    # The executable and any leading words; the adapter appends its own arguments.
    command: Command
    # Where the accepted flags come from. Empty: the engine's own help, read once per
    # executable and version. "captured" or "captured:VERSION": a help text kept in
    # llmgw_agent/engine_help/. Anything else: the path of a saved help text.
    flags_from: str = ""


class EnginesConfig(BaseConfig):
    vllm: EngineCommand = msgspec.field(default_factory=lambda: EngineCommand(command=["vllm"]))
    sglang: EngineCommand = msgspec.field(
        default_factory=lambda: EngineCommand(command=["python", "-m", "sglang.launch_server"])
    )
    llamacpp: EngineCommand = msgspec.field(
        default_factory=lambda: EngineCommand(command=["llama-server"])
    )


def _default_state_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(base) / "llmgw-agent")


class AgentConfig(BaseConfig):
    # Empty means the hostname.
    node_id: str = ""
    control: ControlConfig = msgspec.field(default_factory=ControlConfig)
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    simulate_gpus: SimulatedGpus | None = None
    # The address engines bind. Empty: the advertised address (advertise_host, else the
    # hostname), so an engine listens only where routers dial it. 0.0.0.0 / :: bind every
    # address of the node (each engine still requires its secret).
    engine_host: str = ""
    # The host put into endpoint URLs. Empty: engine_host, or the hostname when
    # engine_host is empty or a wildcard (0.0.0.0 / ::), which no client can dial.
    advertise_host: str = ""
    engines: EnginesConfig = msgspec.field(default_factory=EnginesConfig)
    # Where running shards are recorded so a restarted agent re-adopts them.
    state_dir: str = msgspec.field(default_factory=_default_state_dir)
    stop_grace: Duration = Duration(30.0)
    # Used when a StartShard carries no load_timeout of its own.
    load_timeout: Duration = Duration(1200.0)
    health_interval: Duration = Duration(1.0)
    # How long an engine may take to print its version or help (vLLM's takes ~30 s).
    engine_probe_timeout: Duration = Duration(300.0)
    # How often the engines' metrics are read for load reports, unless RegisterAck says.
    load_interval: Duration = Duration(0.25)
    drain_poll_interval: Duration = Duration(1.0)
    output_tail_lines: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 40
    output_buffer_lines: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 2000
    # An engine's output file is truncated past this size (its tail stays in memory).
    output_file_max_bytes: Annotated[int, msgspec.Meta(ge=4096)] = 64 * 1024 * 1024
    base_backoff: Duration = Duration(0.5)
    max_backoff: Duration = Duration(30.0)
    # A stream that stayed up this long resets the backoff.
    stable_after: Duration = Duration(10.0)
    # Default false: an agent upgrade must not take engines down.
    stop_engines_on_exit: bool = False
    # OpenTelemetry spans of shard starts over OTLP/HTTP (llmgw_proto.tracing); off unless
    # an endpoint is set.
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)

    @property
    def node_name(self) -> str:
        return self.node_id or socket.gethostname()

    @property
    def simulated_memory_bytes(self) -> int:
        return parse_size(self.simulate_gpus.memory) if self.simulate_gpus else 0

    def control_addresses(self) -> list[str]:
        return list(self.control.addresses) or [self.control.address]

    def engine_command(self, name: str) -> list[str]:
        engine: EngineCommand = getattr(self.engines, name)
        return list(engine.command)

    def endpoint_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        if self.engine_host in ("0.0.0.0", "::", ""):
            return socket.gethostname()
        return self.engine_host

    def bind_host(self) -> str:
        """What engines bind: engine_host, or the advertised address when it is empty."""
        return self.engine_host or self.endpoint_host()


def _check(config: AgentConfig, source: str) -> AgentConfig:
    """Cross-field rules msgspec cannot express."""
    if config.max_backoff < config.base_backoff or config.base_backoff <= 0:
        raise ConfigError(source, "must be >= base_backoff and base_backoff > 0", "$.max_backoff")
    problem = keepalive_problem(config.control.keepalive, config.control.keepalive_timeout)
    if problem is not None:
        raise ConfigError(source, problem[1], f"$.control.{problem[0]}")
    if config.simulate_gpus is not None:
        try:
            parse_size(config.simulate_gpus.memory)
        except ValueError as err:
            raise ConfigError(source, str(err), "$.simulate_gpus.memory") from None
    addresses = [("$.control.address", config.control.address)]
    addresses += [(f"$.control.addresses[{i}]", a) for i, a in enumerate(config.control.addresses)]
    for where, address in addresses:
        try:
            parse_hostport(address)
        except ValueError as err:
            raise ConfigError(source, str(err), where) from None
    config.control.tls.check(source, "$.control.tls")
    for key in config.labels:
        if not key:
            raise ConfigError(source, "label names must not be empty", "$.labels")
    check_config(config.tracing, source)
    return config


def load_agent_config(path: str | Path | None, *, insecure: bool = False) -> AgentConfig:
    """Load agent.yaml (or defaults when ``path`` is None); ``insecure`` is the CLI flag.

    A missing certificate, key or CA file is a ConfigError naming the field and the path.
    """
    if path is None:
        data: object = {}
        source = "<defaults>"
    else:
        data = read(Path(path))
        source = str(path)
    if insecure and isinstance(data, dict):
        # Wrong types are left alone so the normal error names them.
        control = data.get("control") or {}
        tls = control.get("tls") or {} if isinstance(control, dict) else None
        if isinstance(control, dict) and isinstance(tls, dict):
            data = {**data, "control": {**control, "tls": {**tls, "insecure": True}}}
    return _check(convert(data, AgentConfig, source=source), source)
