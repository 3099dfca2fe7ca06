"""The router config's `tenants:` section (admission, shares, the fair-share queue)."""

from __future__ import annotations

from typing import Annotated

import msgspec
from llmgw_proto.config import BaseConfig, ConfigError, Duration

__all__ = ["QueueConfig", "TenantsConfig", "check_tenants"]


class QueueConfig(BaseConfig):
    """When the engines a request could go to are full, it is held here, by priority."""

    @property
    def room(self) -> int:
        """The headroom in effect: `headroom`, or a quarter of `per_endpoint` unset."""
        return self.headroom if self.headroom is not None else self.per_endpoint // 4

    # Full: this router's requests in flight for the model reach this many per usable
    # endpoint; each worker caps its own at its part, ceil(per_endpoint / workers), and
    # headroom likewise (Tenancy.cap, Tenancy.headroom). 0: no such cap.
    per_endpoint: Annotated[int, msgspec.Meta(ge=0, le=100_000)] = 0
    # A band above one with requests in flight, and a key with fewer in flight than an
    # equal share of the cap, may go this many requests per usable endpoint past
    # per_endpoint: a request of a higher band, or of a light key, does not wait for a
    # slot while a lower band or a flooding key keeps the engines full. Unset: a quarter
    # of per_endpoint (rounded down); 0: none.
    headroom: Annotated[int, msgspec.Meta(ge=0, le=100_000)] | None = None
    # Full: every endpoint of the model reports (load reports) at least this many
    # requests waiting in its engine. 0: the engines' queues are not looked at.
    engine_waiting: Annotated[int, msgspec.Meta(ge=0, le=100_000)] = 0
    # A held request is answered 503 + Retry-After after this long.
    max_wait: Duration = Duration(30.0)
    # Held requests per model at most; past it the newest of the lowest band is shed.
    max_held: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 1024


class TenantsConfig(BaseConfig):
    """Per-key admission: rates, tokens, concurrency, budgets; priority bands."""

    # Priority bands, highest first; a key names one (`priority`).
    bands: Annotated[list[str], msgspec.Meta(min_length=1)] = msgspec.field(
        default_factory=lambda: ["interactive", "default", "batch"]
    )
    # The band of a key that names none (or one this router does not know).
    default_priority: str = "default"
    # Tokens reserved for the completion when a request sets neither max_tokens nor
    # max_completion_tokens.
    default_max_tokens: Annotated[int, msgspec.Meta(ge=0, le=10_000_000)] = 256
    # Control-plane keys: how often usage is reported (ReportUsage) and shares fetched.
    report_interval: Duration = Duration(1.0)
    # Control-plane keys with no share yet, or none valid (the control plane out of
    # reach past the reply's valid_for): this fraction of each fleet-wide limit.
    fallback_fraction: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.25
    queue: QueueConfig = msgspec.field(default_factory=QueueConfig)


def check_tenants(cfg: TenantsConfig, source: str) -> None:
    """Cross-field rules of `tenants:`; ConfigError names the field."""
    seen: set[str] = set()
    for i, band in enumerate(cfg.bands):
        if not band.strip():
            raise ConfigError(source, "a band name must not be empty", f"$.tenants.bands[{i}]")
        if band in seen:
            raise ConfigError(source, f"band {band!r} is listed twice", f"$.tenants.bands[{i}]")
        seen.add(band)
    if cfg.default_priority not in seen:
        raise ConfigError(
            source,
            f"{cfg.default_priority!r} is not one of the bands {cfg.bands}",
            "$.tenants.default_priority",
        )
    if cfg.report_interval <= 0:
        raise ConfigError(source, "must be > 0 (e.g. `1s`)", "$.tenants.report_interval")
    if cfg.queue.max_wait <= 0:
        raise ConfigError(source, "must be > 0 (e.g. `30s`)", "$.tenants.queue.max_wait")
