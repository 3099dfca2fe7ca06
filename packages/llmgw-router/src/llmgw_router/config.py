"""The router's config file (`router.yaml`), as msgspec Structs.

Every field has a default, so an empty file (or none, with `--endpoint` flags) is a
valid router. Cross-field rules that msgspec cannot express are checked in
:func:`validate`, which names the field like the loader does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec
from llmgw_proto.config import BaseConfig, ConfigError, Duration, load

__all__ = [
    "AffinityConfig",
    "ControlConfig",
    "Deadlines",
    "DeadlinesOverride",
    "EjectionConfig",
    "EndpointConfig",
    "HealthCheckConfig",
    "RetryConfig",
    "RouterConfig",
    "TlsConfig",
    "parse_endpoint_flag",
    "validate",
]

Balancer = Literal["least_outstanding", "round_robin", "session_affinity"]
Server = Literal["uvicorn", "hypercorn"]


class Deadlines(BaseConfig):
    """Per-phase limits on one upstream attempt; `total` spans the whole request."""

    connect: Duration = Duration(2.0)
    # Until the engine's first body byte: a slow prefill counts here, not in `idle`.
    first_byte: Duration = Duration(60.0)
    idle: Duration = Duration(30.0)
    total: Duration = Duration(600.0)


class DeadlinesOverride(BaseConfig):
    """A model's own deadlines; what is left out comes from the global ones."""

    connect: Duration | None = None
    first_byte: Duration | None = None
    idle: Duration | None = None
    total: Duration | None = None

    def over(self, base: Deadlines) -> Deadlines:
        return Deadlines(
            connect=base.connect if self.connect is None else self.connect,
            first_byte=base.first_byte if self.first_byte is None else self.first_byte,
            idle=base.idle if self.idle is None else self.idle,
            total=base.total if self.total is None else self.total,
        )


class RetryConfig(BaseConfig):
    """Retries before the first byte went to the client, each on another endpoint."""

    max_retries: Annotated[int, msgspec.Meta(ge=0, le=10)] = 2
    # The budget: each request earns `budget_ratio` retries, plus a floor per second,
    # so a failing fleet is not hit by a retry storm.
    budget_ratio: Annotated[float, msgspec.Meta(ge=0)] = 0.2
    budget_min_per_second: Annotated[float, msgspec.Meta(ge=0)] = 10.0
    retry_on_429: bool = True


class EjectionConfig(BaseConfig):
    """Passive outlier ejection from the failures real requests see."""

    consecutive_failures: Annotated[int, msgspec.Meta(ge=1)] = 3
    base_time: Duration = Duration(5.0)
    max_time: Duration = Duration(300.0)


class HealthCheckConfig(BaseConfig):
    """Active `GET <health_path>` on every endpoint."""

    enabled: bool = True
    interval: Duration = Duration(5.0)
    timeout: Duration = Duration(2.0)
    unhealthy_threshold: Annotated[int, msgspec.Meta(ge=1)] = 2
    healthy_threshold: Annotated[int, msgspec.Meta(ge=1)] = 1


class AffinityConfig(BaseConfig):
    """Session affinity key: this header, else the body's `user` field."""

    header: str = "x-session-id"


class EndpointConfig(BaseConfig):
    id: Annotated[str, msgspec.Meta(min_length=1)]
    url: Annotated[str, msgspec.Meta(pattern=r"^https?://[^/\s]+")]
    models: Annotated[list[str], msgspec.Meta(min_length=1)]
    profile: str = "static"
    weight: Annotated[int, msgspec.Meta(ge=1, le=10000)] = 1
    health_path: str = "/health"


class TlsConfig(BaseConfig):
    insecure: bool = False
    cert: str | None = None
    key: str | None = None
    ca: str | None = None


class ControlConfig(BaseConfig):
    """The control plane whose `EndpointService.Watch` feeds the endpoint set."""

    address: Annotated[str, msgspec.Meta(pattern=r"^[^:\s]+:\d+$")]
    tls: TlsConfig = msgspec.field(default_factory=TlsConfig)
    router_id: str = ""
    backoff_base: Duration = Duration(0.5)
    backoff_cap: Duration = Duration(30.0)


class ApiKeyConfig(BaseConfig):
    key: Annotated[str, msgspec.Meta(min_length=1)]
    # Shown in logs and metrics instead of the key.
    name: str = ""
    # Served model names this key may use; empty means every model.
    models: list[str] = msgspec.field(default_factory=list)


class KeysFile(BaseConfig):
    keys: list[str | ApiKeyConfig] = msgspec.field(default_factory=list)


@dataclass(frozen=True)
class ApiKey:
    secret: bytes
    name: str
    models: frozenset[str]

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models


def resolve_api_keys(cfg: RouterConfig, source: str) -> tuple[ApiKey, ...]:
    """Every API key from the config and the keys file; ConfigError names file and field."""
    # (file, field path, entry) so that a problem is reported where it was written.
    entries: list[tuple[str, str, str | ApiKeyConfig]] = [
        (source, f"$.api_keys[{i}]", entry) for i, entry in enumerate(cfg.api_keys)
    ]
    if cfg.api_keys_file:
        keys_file = load(cfg.api_keys_file, KeysFile)
        entries += [
            (cfg.api_keys_file, f"$.keys[{i}]", entry) for i, entry in enumerate(keys_file.keys)
        ]
    keys: list[ApiKey] = []
    seen: set[bytes] = set()
    for where, field, entry in entries:
        item = entry if isinstance(entry, ApiKeyConfig) else ApiKeyConfig(key=entry)
        if not item.key.strip():
            raise ConfigError(where, "an API key must not be empty", field)
        secret = item.key.encode()
        if secret in seen:
            raise ConfigError(where, "this API key is listed twice", field)
        seen.add(secret)
        keys.append(ApiKey(secret, item.name or f"key-{len(keys) + 1}", frozenset(item.models)))
    return tuple(keys)


class RouterConfig(BaseConfig):
    listen: str = "0.0.0.0:8080"
    admin_listen: str = "127.0.0.1:9090"
    default_profile: str = ""
    balancer: Balancer = "least_outstanding"
    affinity: AffinityConfig = msgspec.field(default_factory=AffinityConfig)
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1)] = 16 * 1024 * 1024
    # Bearer tokens: plain strings, or {key, name, models} to limit a key to some models.
    api_keys: list[str | ApiKeyConfig] = msgspec.field(default_factory=list)
    # More keys from a YAML/TOML file of the form `keys: [...]` (same entries as api_keys),
    # so secrets need not sit in the main config.
    api_keys_file: str = ""
    deadlines: Deadlines = msgspec.field(default_factory=Deadlines)
    # Per served model name: deadlines that differ from the global ones.
    model_deadlines: dict[str, DeadlinesOverride] = msgspec.field(default_factory=dict)
    retries: RetryConfig = msgspec.field(default_factory=RetryConfig)
    ejection: EjectionConfig = msgspec.field(default_factory=EjectionConfig)
    health_checks: HealthCheckConfig = msgspec.field(default_factory=HealthCheckConfig)
    endpoints: list[EndpointConfig] = msgspec.field(default_factory=list)
    control: ControlConfig | None = None
    # Seconds in-flight requests get to finish after SIGTERM.
    shutdown_grace: Duration = Duration(30.0)
    server: Server = "uvicorn"
    # Upstream keep-alive pool: idle connections kept per endpoint (0: no limit), and
    # how long one may idle; under vLLM's own 5 s so the engine never closes one first.
    pool_per_endpoint: Annotated[int, msgspec.Meta(ge=0)] = 0
    keepalive: Duration = Duration(4.0)

    def deadlines_for(self, model: str) -> Deadlines:
        override = self.model_deadlines.get(model)
        return self.deadlines if override is None else override.over(self.deadlines)


def _host_port(value: str) -> bool:
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def validate(cfg: RouterConfig, source: str) -> RouterConfig:
    """Rules across fields; raises :class:`ConfigError` naming the field."""
    for name in ("listen", "admin_listen"):
        if not _host_port(getattr(cfg, name)):
            raise ConfigError(
                source, f"Expected HOST:PORT, got {getattr(cfg, name)!r}", f"$.{name}"
            )
    seen: set[str] = set()
    for i, ep in enumerate(cfg.endpoints):
        if ep.id in seen:
            raise ConfigError(source, f"duplicate endpoint id {ep.id!r}", f"$.endpoints[{i}].id")
        seen.add(ep.id)
    if cfg.ejection.max_time < cfg.ejection.base_time:
        raise ConfigError(source, "must be >= ejection.base_time", "$.ejection.max_time")
    if cfg.control is not None:
        tls = cfg.control.tls
        if not tls.insecure:
            for name in ("cert", "key", "ca"):
                if not getattr(tls, name):
                    raise ConfigError(
                        source,
                        "required unless control.tls.insecure is true (or --insecure)",
                        f"$.control.tls.{name}",
                    )
        if cfg.control.backoff_cap < cfg.control.backoff_base or cfg.control.backoff_base <= 0:
            raise ConfigError(source, "need 0 < backoff_base <= backoff_cap", "$.control")
    return cfg


def parse_endpoint_flag(value: str) -> EndpointConfig:
    """`id=URL=model[,model]` from `--endpoint`; raises ValueError saying what is wrong."""
    parts = value.split("=")
    if len(parts) != 3:
        raise ValueError(f"expected id=URL=model[,model], got {value!r}")
    ident, url, models = (p.strip() for p in parts)
    names = [m.strip() for m in models.split(",") if m.strip()]
    if not ident:
        raise ValueError(f"empty endpoint id in {value!r}")
    if not url.startswith(("http://", "https://")) or len(url.split("//", 1)[1]) == 0:
        raise ValueError(f"URL must start with http:// or https:// in {value!r}")
    if not names:
        raise ValueError(f"no model names in {value!r}")
    return EndpointConfig(id=ident, url=url.rstrip("/"), models=names, profile="static")
