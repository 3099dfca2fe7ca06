"""The router's config file (`router.yaml`), as msgspec Structs.

Every field has a default, so an empty file (or none, with `--endpoint` flags) is a
valid router. Cross-field rules that msgspec cannot express are checked in
:func:`validate`, which names the field like the loader does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from llmgw_proto.addr import HostPort, parse_endpoint_url, parse_hostport
from llmgw_proto.config import BaseConfig, ConfigError, Duration, load
from llmgw_proto.keepalive import keepalive_problem
from llmgw_proto.tls import TlsConfig
from llmgw_proto.tracing import TracingConfig, check_config

from llmgw_router.tenants.config import TenantsConfig, check_tenants
from llmgw_router.tenants.limits import KeyLimits
from llmgw_router.tokens import PromptTokenizer, TokenizerError

__all__ = [
    "AffinityConfig",
    "CacheAwareConfig",
    "ControlConfig",
    "Deadlines",
    "DeadlinesOverride",
    "DisaggConfig",
    "EjectionConfig",
    "EndpointConfig",
    "HealthCheckConfig",
    "HoldConfig",
    "HttpConfig",
    "LoadReportsConfig",
    "RetryConfig",
    "RouterConfig",
    "TlsConfig",
    "WarmingConfig",
    "parse_endpoint_flag",
    "validate",
]

Balancer = Literal["cache_aware", "least_outstanding", "round_robin", "session_affinity"]
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
    # After the first byte: a streamed chat or text completion whose engine breaks off
    # is resumed on another replica this many times at most (0: never; issue 28).
    max_resumes: Annotated[int, msgspec.Meta(ge=0, le=10)] = 2
    # Non-streamed chat and text completions resumed too: asked of the engine as a stream
    # and gathered into the one JSON answer (proxy/gather.py). Off by default: it costs
    # the router a stream's relaying for every such request (2.7x the instructions of a
    # 16-token answer), where a break only costs a retry from the start.
    resume_unstreamed: bool = False


class EjectionConfig(BaseConfig):
    """Passive outlier ejection from the failures real requests see."""

    consecutive_failures: Annotated[int, msgspec.Meta(ge=1)] = 3
    base_time: Duration = Duration(5.0)
    max_time: Duration = Duration(300.0)
    # At most this share of a model's endpoints is ejected at once (one always may be).
    max_ejection_percent: Annotated[float, msgspec.Meta(ge=0, le=100)] = 50.0
    # Fewer usable than this share of a model's endpoints: balance over all of them,
    # ejected or not (panic), rather than answer 503.
    panic_threshold: Annotated[float, msgspec.Meta(ge=0, le=100)] = 50.0


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


class CacheAwareConfig(BaseConfig):
    """The `cache_aware` balancer: prefix affinity bounded by load."""

    # The prompt (chat messages in order, or the completion prompt) is cut into blocks
    # of this many bytes of its text (prefix.prompt_text); a block is the unit of prefix
    # matching.
    # (For a model in `tokenizers`: of block_bytes / 4 of its tokens.)
    block_bytes: Annotated[int, msgspec.Meta(ge=16, le=65536)] = 256
    # Rendezvous hashing places a request by its first this-many blocks, so routers
    # agree on a prefix's endpoint without talking.
    affinity_blocks: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 8
    # Only this many blocks of a prompt are hashed (longer prompts share their start).
    max_blocks: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 256
    # Bounded load: affinity never sends to an endpoint whose load, with the request,
    # would exceed ceil((1 + epsilon) x its share of the model's load) + slack requests
    # (scaled by weight / mean weight); the least loaded takes it instead. A prefix that
    # wants more than (1 + epsilon) x one endpoint's fair share spreads over
    # ceil(share x endpoints / (1 + epsilon)) of them.
    epsilon: Annotated[float, msgspec.Meta(ge=0, le=100)] = 0.25
    # The absolute part of the bound, in requests: at small in-flight counts one request
    # more is already far above (1 + epsilon) x the mean, and spilling there costs a miss.
    slack: Annotated[float, msgspec.Meta(ge=0, le=1000)] = 3.0
    # A prefix's demand is its share of this router's last this-many picks.
    window: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 256
    # Prefix blocks remembered per endpoint of what this router sent (LRU).
    index_blocks: Annotated[int, msgspec.Meta(ge=0, le=10_000_000)] = 16384
    # Where the engines' cache sizes are known: a new prefix's home by a rule every router
    # computes alike (balancing/placement.py), for several routers in front of one fleet;
    # false: the first rendezvous choice with room in this router's own record (better
    # for a router alone: it knows every prefix it sent).
    shared_homes: bool = False
    # With shared_homes behind a control plane: every second, share the prefixes of this
    # router's recent picks through it (SharePrefixes) and place homes over every
    # router's, so routers that each see a part of the traffic place alike. A router with
    # static endpoints only has no control plane to share through.
    share_prefixes: bool = True
    # With share_prefixes: a prefix the fleet's routers sent somewhere keeps its home
    # there only while the prefixes held there fit that engine's cache (the rest are
    # placed by the rule), and a router sends it to that home, not to its own copies
    # elsewhere; false (the rule before, for comparison): wherever the fleet sent it,
    # whatever else that engine holds, and a router's own copies still count.
    fit_holders: bool = True
    # Rank endpoints for a prefix by their slot (Endpoint.slot from the control plane; a
    # static endpoint's `slot`) where set, else by id: a replica that replaces another in
    # its slot (a rolling update) inherits exactly its prefixes. False: by id (for
    # comparison: each replacement then takes a fresh share of every replica's prefixes).
    use_slots: bool = True
    # Prompt bytes per engine token, to count an engine's cache (reported or configured
    # in tokens) in prefix blocks of block_bytes; 4 for English text with common
    # tokenizers. (With a tokenizer, blocks are block_bytes / 4 tokens: leave it at 4.)
    bytes_per_token: Annotated[float, msgspec.Meta(gt=0, le=1024)] = 4.0
    # Precise matching: served model name -> the folder of its tokenizer files (what the
    # engine loads: tokenizer.json, tokenizer_config.json). The router then tokenizes that
    # model's prompts as the engine does and matches them against the blocks the engines
    # report cached (KV events). Needs the `precise` extra.
    tokenizers: dict[str, str] = {}
    # The token ids of prompt segments kept so that each prefix of a conversation is
    # tokenized once (tokens.TokenCache), in bytes, for all of a worker's tokenizers
    # together (LRU); 0 keeps none.
    token_cache_bytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)] = 64 * 1024 * 1024


class WarmingConfig(BaseConfig):
    """Warming before a drain (proxy/warm.py): an endpoint the control plane marks leaving
    gets no new request, and its hot prompts are sent to their new homes first."""

    enabled: bool = True
    # Distinct recent prompts (by rendezvous block) sampled per endpoint.
    samples_per_endpoint: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 64
    # Prefill-only requests per leaving endpoint at most, and at once.
    max_requests: Annotated[int, msgspec.Meta(ge=0, le=4096)] = 32
    concurrency: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2
    # Their prompt tokens together at most this share of what this router sent the
    # leaving endpoint to prefill lately (its last cache_aware.window requests).
    max_prefill_fraction: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.1
    # One prefill-only request's limit, in seconds.
    timeout: Annotated[float, msgspec.Meta(gt=0, le=600)] = 30.0


class DisaggConfig(BaseConfig):
    """Disaggregated models (proxy/disagg.py): which requests take the two-phase path."""

    # A vLLM-family request whose prompt is estimated (body bytes / 4) under this many
    # tokens goes straight to a decode engine, which prefills it itself; 0: every request
    # is prefilled on a prefill engine. SGLang decode engines take only transferred
    # requests, so its models always go through both phases.
    min_prompt_tokens: Annotated[int, msgspec.Meta(ge=0, le=1 << 24)] = 0


class LoadReportsConfig(BaseConfig):
    """The engines' load figures from the control plane's `EndpointService.WatchLoad`."""

    enabled: bool = True
    # A figure older than this counts as unknown: the router balances on its own counts.
    max_age: Duration = Duration(2.0)


class HoldConfig(BaseConfig):
    """Requests for a declared model with no endpoint yet (scale to zero) wait here."""

    enabled: bool = True
    # How long a request is held before 503 + Retry-After.
    hold_timeout: Duration = Duration(120.0)
    # Requests held per model at most; more get 503 + Retry-After at once.
    max_held: Annotated[int, msgspec.Meta(ge=0)] = 256
    # How often the router repeats ReportDemand while it holds requests.
    demand_interval: Duration = Duration(5.0)


class HttpConfig(BaseConfig):
    """Limits on what a client may send the router's HTTP server before it is judged."""

    # The request line and headers together, in bytes: past it 414 (the request line
    # alone is longer) or 431, and the connection closes.
    max_head_bytes: Annotated[int, msgspec.Meta(ge=1024, le=16 * 1024 * 1024)] = 64 * 1024
    # From a request's first byte (or a new connection's accept) until its head is
    # complete; then 408 and the connection closes.
    head_timeout: Duration = Duration(10.0)
    # From the end of the head until the whole body has arrived; then 408 and close.
    body_timeout: Duration = Duration(30.0)
    # Client connections one router worker holds at once; a request on a connection
    # beyond it is answered 503 (with Retry-After) and that connection closes.
    max_connections: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 4096


class EndpointConfig(BaseConfig):
    id: Annotated[str, msgspec.Meta(min_length=1)]
    url: Annotated[str, msgspec.Meta(pattern=r"^https?://[^/\s]+")]
    models: Annotated[list[str], msgspec.Meta(min_length=1)]
    profile: str = "static"
    weight: Annotated[int, msgspec.Meta(ge=1, le=10000)] = 1
    health_path: str = "/health"
    # The engine's KV cache in tokens (vLLM: num_gpu_blocks x block_size), for
    # cache_aware's capacity-aware placement; 0: not known (engines behind a control
    # plane report it themselves).
    cache_tokens: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)] = 0
    # A disaggregated model's pool (issue 32): prefill or decode (proxy/disagg.py), the
    # engine family (whose protocol the two phases speak) and its KV/bootstrap port.
    role: Literal["", "prefill", "decode"] = ""
    engine: Literal["", "vllm", "sglang", "llamacpp"] = ""
    kv_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    # Its place in cache_aware's ranking (cache_aware.use_slots): an endpoint given the
    # slot of one it replaces takes over exactly that one's prefixes; "": its id.
    slot: Annotated[str, msgspec.Meta(max_length=256)] = ""


class ControlConfig(BaseConfig):
    """The control plane whose `EndpointService.Watch` feeds the endpoint set."""

    # HOST:PORT of the control plane; a DNS name may resolve to several instances.
    address: str = ""
    # Several control-plane instances (high availability): tried in turn, and a
    # standby's `llmgw-leader` answer is followed to the leader.
    addresses: list[str] = msgspec.field(default_factory=list)
    tls: TlsConfig = msgspec.field(default_factory=TlsConfig)
    router_id: str = ""
    backoff_base: Duration = Duration(0.5)
    backoff_cap: Duration = Duration(30.0)
    # An HTTP/2 ping every `keepalive`; one unanswered for `keepalive_timeout` gives the
    # streams up (a control plane frozen or gone without closing the connection), and
    # the next control plane is tried.
    keepalive: Duration = Duration(10.0)
    keepalive_timeout: Duration = Duration(10.0)

    def targets(self) -> list[HostPort]:
        """Every configured control-plane address, `address` first."""
        raw = ([self.address] if self.address else []) + list(self.addresses)
        return [parse_hostport(a) for a in raw]

    def describe(self) -> str:
        raw = ([self.address] if self.address else []) + list(self.addresses)
        return ", ".join(raw)


class ApiKeyConfig(BaseConfig):
    key: Annotated[str, msgspec.Meta(min_length=1)]
    # Shown in logs and metrics instead of the key.
    name: str = ""
    # Served model names this key may use; empty means every model.
    models: list[str] = msgspec.field(default_factory=list)
    # Limits (0: none), for this router (divided among its workers): requests and
    # tokens per minute, requests at once, a token budget per period (`day`/`month`).
    rpm: Annotated[int, msgspec.Meta(ge=0)] = 0
    tpm: Annotated[int, msgspec.Meta(ge=0)] = 0
    max_concurrent: Annotated[int, msgspec.Meta(ge=0)] = 0
    budget_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    budget_period: Literal["day", "month"] = "month"
    # A band of `tenants.bands` ("": tenants.default_priority), and the key's weight in it.
    priority: str = ""
    weight: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 1


class KeysFile(BaseConfig):
    keys: list[str | ApiKeyConfig] = msgspec.field(default_factory=list)


@dataclass(frozen=True)
class ApiKey:
    # The secret; for a key from the control plane empty (``sha256`` is its hash).
    secret: bytes
    name: str
    models: frozenset[str]
    limits: KeyLimits = dataclasses.field(default_factory=KeyLimits)
    priority: str = ""
    weight: int = 1
    budget_period: str = ""
    # A control-plane key's lookup prefix (`llmgw_<8 hex>`) and the secret's hex SHA-256.
    prefix: str = ""
    sha256: str = ""
    # Router-config keys: True; the control plane's limits are fleet-wide (shared out).
    local: bool = True

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
        limits = KeyLimits(item.rpm, item.tpm, item.max_concurrent, item.budget_tokens)
        keys.append(
            ApiKey(
                secret,
                item.name or f"key-{len(keys) + 1}",
                frozenset(item.models),
                limits=limits,
                priority=item.priority,
                weight=item.weight,
                budget_period=item.budget_period if item.budget_tokens else "",
            )
        )
        if item.priority and item.priority not in cfg.tenants.bands:
            raise ConfigError(
                where,
                f"priority {item.priority!r} is not one of tenants.bands {cfg.tenants.bands}",
                f"{field}.priority",
            )
    return tuple(keys)


class RouterConfig(BaseConfig):
    listen: str = "0.0.0.0:8080"
    admin_listen: str = "127.0.0.1:9090"
    default_profile: str = ""
    balancer: Balancer = "cache_aware"
    affinity: AffinityConfig = msgspec.field(default_factory=AffinityConfig)
    cache_aware: CacheAwareConfig = msgspec.field(default_factory=CacheAwareConfig)
    warming: WarmingConfig = msgspec.field(default_factory=WarmingConfig)
    disagg: DisaggConfig = msgspec.field(default_factory=DisaggConfig)
    load_reports: LoadReportsConfig = msgspec.field(default_factory=LoadReportsConfig)
    hold: HoldConfig = msgspec.field(default_factory=HoldConfig)
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1)] = 16 * 1024 * 1024
    http: HttpConfig = msgspec.field(default_factory=HttpConfig)
    # Bearer tokens: plain strings, or {key, name, models} to limit a key to some models.
    api_keys: list[str | ApiKeyConfig] = msgspec.field(default_factory=list)
    # More keys from a YAML/TOML file of the form `keys: [...]` (same entries as api_keys),
    # so secrets need not sit in the main config.
    api_keys_file: str = ""
    # Per-key admission (limits, shares, priority bands, the fair-share queue).
    tenants: TenantsConfig = msgspec.field(default_factory=TenantsConfig)
    # OpenTelemetry spans over OTLP/HTTP (llmgw_proto.tracing); no endpoint: off.
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)
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
    # Router processes sharing `listen` (SO_REUSEPORT) under one supervisor; unset: one
    # per core this process may use. 1: a single process, no supervisor.
    workers: Annotated[int, msgspec.Meta(ge=1, le=1024)] | None = None

    def deadlines_for(self, model: str) -> Deadlines:
        override = self.model_deadlines.get(model)
        return self.deadlines if override is None else override.over(self.deadlines)


def validate(cfg: RouterConfig, source: str) -> RouterConfig:
    """Rules across fields; raises :class:`ConfigError` naming the field."""
    for name in ("listen", "admin_listen"):
        try:
            parse_hostport(getattr(cfg, name))
        except ValueError as err:
            raise ConfigError(
                source, str(err).replace("expected", "Expected", 1), f"$.{name}"
            ) from None
    seen: set[str] = set()
    for i, ep in enumerate(cfg.endpoints):
        if ep.id in seen:
            raise ConfigError(source, f"duplicate endpoint id {ep.id!r}", f"$.endpoints[{i}].id")
        seen.add(ep.id)
        try:
            # The control plane's rule for what it publishes: a router never dials a
            # URL it cannot parse (issue 24.7).
            parse_endpoint_url(ep.url)
        except ValueError as err:
            raise ConfigError(source, str(err), f"$.endpoints[{i}].url") from None
    for name in ("head_timeout", "body_timeout"):
        if getattr(cfg.http, name) <= 0:
            raise ConfigError(source, "must be > 0 (e.g. `10s`)", f"$.http.{name}")
    if cfg.ejection.max_time < cfg.ejection.base_time:
        raise ConfigError(source, "must be >= ejection.base_time", "$.ejection.max_time")
    if cfg.control is not None:
        control = cfg.control
        problem = keepalive_problem(control.keepalive, control.keepalive_timeout)
        if problem is not None:
            raise ConfigError(source, problem[1], f"$.control.{problem[0]}")
        if not control.address and not control.addresses:
            raise ConfigError(
                source, "give `address` or `addresses` (HOST:PORT)", "$.control.address"
            )
        named = [("$.control.address", control.address)] if control.address else []
        named += [(f"$.control.addresses[{i}]", a) for i, a in enumerate(control.addresses)]
        for where, value in named:
            try:
                parse_hostport(value)
            except ValueError as err:
                raise ConfigError(
                    source, str(err).replace("expected", "Expected", 1), where
                ) from None
        # Missing cert/key/ca: named by field and path, before anything starts.
        control.tls.check(source, "$.control.tls")
        if control.backoff_cap < control.backoff_base or control.backoff_base <= 0:
            raise ConfigError(source, "need 0 < backoff_base <= backoff_cap", "$.control")
    for model, folder in cfg.cache_aware.tokenizers.items():
        where = f"$.cache_aware.tokenizers[{model!r}]"
        if not Path(folder).is_dir():
            why = "not a directory" if Path(folder).exists() else "no such directory"
            raise ConfigError(source, f"{why}: {folder}", where)
        try:
            PromptTokenizer(Path(folder))
        except TokenizerError as err:
            raise ConfigError(source, str(err), where) from None
    check_tenants(cfg.tenants, source)
    check_config(cfg.tracing, source)
    if cfg.api_keys_file:
        path = Path(cfg.api_keys_file)
        if not path.is_file():
            why = "is a directory" if path.is_dir() else "no such file"
            raise ConfigError(source, f"{why}: {cfg.api_keys_file}", "$.api_keys_file")
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
    try:
        parse_endpoint_url(url)
    except ValueError as err:
        raise ValueError(f"{err} in {value!r}") from None
    if not names:
        raise ValueError(f"no model names in {value!r}")
    return EndpointConfig(id=ident, url=url.rstrip("/"), models=names, profile="static")
