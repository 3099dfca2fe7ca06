"""The model catalog: what should run, and every check of it in one place.

The config file declares models, each with named profiles (how to run it: engine,
arguments, GPUs per node, nodes per replica, constraints, replicas wanted). The
schema below rejects wrong types; :func:`build_catalog` rejects what types cannot
say, naming the file and field like every other config error.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass, field
from typing import Annotated, Literal

import msgspec
from llmgw_proto.config import BaseConfig, ConfigError, Duration
from llmgw_proto.sizes import parse_size

from llmgw_control.lora_catalog import AdapterSpec, check_adapters, lora_launch
from llmgw_control.pd_catalog import pd_pools
from llmgw_control.pd_catalog import with_role as _with_role

__all__ = [
    "AdapterConfig",
    "AdapterSpec",
    "AutoscaleConfig",
    "Catalog",
    "GpuConstraint",
    "LoraConfig",
    "ModelConfig",
    "PoolConfig",
    "ProfileConfig",
    "ProfileSpec",
    "ReplicaRange",
    "RolloutConfig",
    "build_catalog",
]

EngineName = Literal["vllm", "sglang", "llamacpp"]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]


class GpuConstraint(BaseConfig):
    # A shell-style pattern on the NVML name, e.g. "NVIDIA H100*".
    name: str = "*"
    # "40GiB", "40Gi", "80GB", "80G", "24576MiB" or bytes (llmgw_proto.sizes); "" means any.
    min_memory: str | int = ""


class ReplicaRange(BaseConfig):
    """``replicas: {min, max}``: autoscaled between the two on the engines' load."""

    min: NonNegative
    max: Positive


class AutoscaleConfig(BaseConfig):
    # waiting: requests queued per ready replica; kv_cache: mean KV-cache use (0..1).
    metric: Literal["waiting", "kv_cache"] = "waiting"
    target: Annotated[float, msgspec.Meta(gt=0)] = 4.0
    # Scale up once the target has been exceeded this long ...
    up_after: Duration = Duration(30.0)
    # ... and down (by drain) once the load would fit one replica fewer for this long.
    down_after: Duration = Duration(300.0)


class RolloutConfig(BaseConfig):
    # New replicas started above the wanted count while a changed profile rolls ...
    max_surge: NonNegative = 1
    # ... and ready replicas that may be missing meanwhile.
    max_unavailable: NonNegative = 0
    # No new replica is started while one started before it has been ready for less than
    # this (the routers warm it meanwhile: one step's cache misses at a time; issue 28).
    min_ready: Duration = Duration(0.0)


class LoraConfig(BaseConfig):
    """``lora:``: the engine serves LoRA adapters, this many at once, up to this rank."""

    max_loras: Positive = 4
    max_rank: Positive = 16
    # An adapter used more recently than this is not unloaded for another: keep it above
    # the routers' hold.demand_interval (they report use that often).
    min_idle: Duration = Duration(10.0)


class AdapterConfig(BaseConfig):
    # The name requests give as `model`; source: a path on the nodes or a hub id.
    name: str
    source: str


class PoolConfig(BaseConfig):
    """``prefill:`` / ``decode:``: one role's pool of a disaggregated profile (issue 32).

    Unset fields take the profile's value; engine_args are added after the profile's.
    """

    replicas: NonNegative | ReplicaRange = 1
    gpus_per_node: NonNegative | None = None
    nodes: Positive | None = None
    engine_args: list[str] = []


class ProfileConfig(BaseConfig):
    engine: EngineName
    model_ref: str = ""
    engine_args: list[str] = []
    env: dict[str, str] = {}
    gpus_per_node: NonNegative = 1
    cpu_threads: NonNegative = 0
    nodes: Positive = 1
    gpu: GpuConstraint = msgspec.field(default_factory=GpuConstraint)
    same_label: str = ""
    # Replicas of this profile spread over: node (the default), none (pack), or a label.
    spread: str = "node"
    replicas: NonNegative | ReplicaRange = 1
    autoscale: AutoscaleConfig = msgspec.field(default_factory=AutoscaleConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    # With replicas.min 0: back to zero after no request and no demand for this long.
    idle_after: Duration = Duration(600.0)
    served_model_names: list[str] = []
    weight: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 1
    load_timeout: Duration = Duration(600.0)
    # LoRA adapters: the engine's limits (None: the engine serves none).
    lora: LoraConfig | None = None
    # Prefill/decode disaggregation (issue 32): both pools, and the node label whose
    # value they share (the KV cache moves over that fabric), e.g. fabric.ib-subnet.
    prefill: PoolConfig | None = None
    decode: PoolConfig | None = None
    fabric_label: str = ""


class ModelConfig(BaseConfig):
    name: str
    profiles: dict[str, ProfileConfig] = {}
    # LoRA adapters over this model, loaded where requests want them (issue 30).
    adapters: list[AdapterConfig] = []


@dataclass(frozen=True)
class ProfileSpec:
    """One validated profile, with defaults resolved (served names, memory in bytes)."""

    model: str
    name: str
    engine: EngineName
    model_ref: str
    engine_args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    gpus_per_node: int
    cpu_threads: int
    nodes: int
    gpu_name: str
    min_memory_bytes: int
    same_label: str
    # Wanted replicas: the fixed count, or the autoscaler's floor (replicas.min).
    replicas: int
    served_model_names: tuple[str, ...]
    weight: int
    load_timeout: float
    min_replicas: int = -1
    max_replicas: int = -1
    autoscale_metric: str = "waiting"
    autoscale_target: float = 4.0
    up_after: float = 30.0
    down_after: float = 300.0
    idle_after: float = 600.0
    max_surge: int = 1
    max_unavailable: int = 0
    min_ready: float = 0.0
    # LoRA adapters the engine holds at once (0: it serves none), and how long one must
    # go unused before it is unloaded for another.
    max_loras: int = 0
    lora_min_idle: float = 10.0
    # What replicas spread over: "node", "none" or a node label (placement.Demand).
    spread: str = "node"
    # Disaggregated profiles (issue 32): this spec is one pool, "prefill" or "decode"
    # ("" for an aggregated profile), of the profile named ``pd_group``; both pools'
    # nodes share one value of ``fabric_label``.
    role: str = ""
    pd_group: str = ""
    fabric_label: str = ""

    def __post_init__(self) -> None:
        if self.min_replicas < 0:
            object.__setattr__(self, "min_replicas", self.replicas)
        if self.max_replicas < 0:
            object.__setattr__(self, "max_replicas", self.replicas)

    @property
    def key(self) -> tuple[str, str]:
        return (self.model, self.name)

    @property
    def autoscaled(self) -> bool:
        return self.max_replicas > self.min_replicas

    @functools.cached_property
    def revision(self) -> str:
        """What the engine is started with; a change rolls the replicas (replicas alone scale)."""
        launch: tuple[object, ...] = (
            self.engine,
            self.model_ref,
            self.engine_args,
            self.env,
            self.gpus_per_node,
            self.cpu_threads,
            self.nodes,
            self.gpu_name,
            self.min_memory_bytes,
            self.same_label,
            self.served_model_names,
        )
        if self.role:  # appended only here: aggregated profiles keep their revisions
            launch += (self.role, self.fabric_label)
        return hashlib.blake2b(repr(launch).encode(), digest_size=6).hexdigest()


@dataclass(frozen=True)
class Catalog:
    """Every profile of every model, in config order."""

    profiles: tuple[ProfileSpec, ...] = ()
    # Every model's LoRA adapters, in config order.
    adapters: tuple[AdapterSpec, ...] = ()
    _by_key: dict[tuple[str, str], ProfileSpec] = field(default_factory=dict, compare=False)
    _by_adapter: dict[str, AdapterSpec] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        self._by_key.update({p.key: p for p in self.profiles})
        self._by_adapter.update({a.name: a for a in self.adapters})

    def adapter(self, name: str) -> AdapterSpec | None:
        """The LoRA adapter a client's model name means, if it names one."""
        return self._by_adapter.get(name)

    def adapters_of(self, model: str) -> list[AdapterSpec]:
        return [a for a in self.adapters if a.model == model]

    def get(self, model: str, profile: str) -> ProfileSpec | None:
        return self._by_key.get((model, profile))

    def models(self) -> list[str]:
        return list(dict.fromkeys(p.model for p in self.profiles))

    def of_model(self, model: str) -> list[ProfileSpec]:
        return [p for p in self.profiles if p.model == model]

    def model_of(self, name: str) -> str | None:
        """The model a client's name means: a model name or one of its served names."""
        for p in self.profiles:
            if name == p.model or name in p.served_model_names:
                return p.model
        return None


# Names become parts of replica and shard ids and of metric labels: keep them plain.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$")
_PROFILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def build_catalog(models: list[ModelConfig], source: str) -> Catalog:
    """Check what the schema cannot and resolve defaults; raise a located ConfigError."""
    profiles: list[ProfileSpec] = []
    seen_models: dict[str, int] = {}
    served_by: dict[str, str] = {}
    for i, model in enumerate(models):
        where = f"$.models[{i}]"
        if not _NAME.match(model.name):
            raise ConfigError(
                source,
                f"model name {model.name!r} must start with a letter or digit and contain "
                "no spaces (letters, digits and . _ : / @ + -)",
                f"{where}.name",
            )
        if model.name in seen_models:
            raise ConfigError(
                source,
                f"model {model.name!r} is already defined at $.models[{seen_models[model.name]}]",
                f"{where}.name",
            )
        seen_models[model.name] = i
        if not model.profiles:
            raise ConfigError(
                source,
                "a model needs at least one profile (a router-only run uses static "
                "endpoints: llmgw-router serve --endpoint ...)",
                f"{where}.profiles",
            )
        for name, profile in model.profiles.items():
            at = f"{where}.profiles.{name}"
            pools = pd_pools(name, profile, set(model.profiles), source, at)
            specs = [
                _with_role(
                    _check_profile(model.name, pool, config, source, at), role, name, profile
                )
                for role, pool, config in pools
            ] or [_check_profile(model.name, name, profile, source, at)]
            for spec in specs:
                for served in spec.served_model_names:
                    owner = served_by.setdefault(served, model.name)
                    if owner != model.name:
                        raise ConfigError(
                            source,
                            f"served model name {served!r} is already served by model {owner!r}; "
                            "a name must pick one model",
                            f"{at}.served_model_names",
                        )
            profiles += specs
    # Adapters last: their names must differ from every model's served names.
    adapters: list[AdapterSpec] = []
    names = {
        served: f"a served model name of model {owner!r}" for served, owner in served_by.items()
    }
    for i, model in enumerate(models):
        listed = check_adapters(
            model.name,
            [(a.name, a.source) for a in model.adapters],
            any(p.lora is not None for p in model.profiles.values()),
            names,
            source,
            f"$.models[{i}]",
            sglang=any(
                p.lora is not None and p.engine == "sglang" for p in model.profiles.values()
            ),
        )
        for a in listed:
            names[a.name] = f"an adapter of model {model.name!r}"
        adapters += listed
    return Catalog(tuple(profiles), tuple(adapters))


def _check_profile(
    model: str, name: str, profile: ProfileConfig, source: str, where: str
) -> ProfileSpec:
    if not _PROFILE_NAME.match(name):
        raise ConfigError(
            source,
            f"profile name {name!r} may contain only letters, digits, _ and -",
            where,
        )
    for j, arg in enumerate(profile.engine_args):
        if not arg:
            raise ConfigError(
                source, "an engine argument must not be empty", f"{where}.engine_args[{j}]"
            )
    for key in profile.env:
        if not _ENV_NAME.match(key):
            raise ConfigError(
                source, f"{key!r} is not a valid environment variable name", f"{where}.env"
            )
        if key == "CUDA_VISIBLE_DEVICES":
            raise ConfigError(
                source,
                "CUDA_VISIBLE_DEVICES is set by the agent from the GPUs placement assigns",
                f"{where}.env.{key}",
            )
    try:
        raw = profile.gpu.min_memory
        min_memory = 0 if isinstance(raw, str) and not raw.strip() else parse_size(raw)
    except ValueError as err:
        raise ConfigError(source, str(err), f"{where}.gpu.min_memory") from None
    if profile.gpus_per_node == 0:
        if profile.gpu != GpuConstraint():
            raise ConfigError(
                source,
                "GPU constraints need gpus_per_node >= 1 (0 means a CPU-only profile)",
                f"{where}.gpu",
            )
        if profile.nodes > 1:
            raise ConfigError(
                source, "a multi-node profile needs gpus_per_node >= 1", f"{where}.nodes"
            )
    elif profile.cpu_threads:
        raise ConfigError(
            source,
            "cpu_threads is for CPU-only profiles (gpus_per_node: 0)",
            f"{where}.cpu_threads",
        )
    if profile.same_label and profile.nodes == 1:
        raise ConfigError(
            source,
            "same_label only applies to multi-node profiles (nodes >= 2)",
            f"{where}.same_label",
        )
    if profile.nodes > 1 and profile.engine == "llamacpp":
        raise ConfigError(
            source, "llama.cpp replicas run on one node: use nodes: 1", f"{where}.nodes"
        )
    spread = profile.spread.strip()
    if not spread:
        raise ConfigError(
            source,
            "spread must be node, none, or a node label such as zone",
            f"{where}.spread",
        )
    served = tuple(profile.served_model_names) or (model,)
    for j, served_name in enumerate(served):
        if not served_name.strip():
            raise ConfigError(
                source, "a served model name must not be empty", f"{where}.served_model_names[{j}]"
            )
    if len(set(served)) != len(served):
        raise ConfigError(
            source, "served model names must not repeat", f"{where}.served_model_names"
        )
    if profile.load_timeout <= 0:
        raise ConfigError(source, "load_timeout must be > 0", f"{where}.load_timeout")
    if isinstance(profile.replicas, ReplicaRange):
        low, high = profile.replicas.min, profile.replicas.max
        if low > high:
            raise ConfigError(
                source, f"min ({low}) must not exceed max ({high})", f"{where}.replicas"
            )
    else:
        low = high = profile.replicas
    a = profile.autoscale
    if a.metric == "kv_cache" and a.target > 1:
        raise ConfigError(
            source,
            f"a kv_cache target is a share of the cache, 0..1 (got {a.target:g})",
            f"{where}.autoscale.target",
        )
    for window in ("up_after", "down_after"):
        if getattr(a, window) < 0:
            raise ConfigError(source, f"{window} must be >= 0", f"{where}.autoscale.{window}")
    if profile.idle_after <= 0:
        raise ConfigError(source, "idle_after must be > 0", f"{where}.idle_after")
    if profile.rollout.max_surge == 0 and profile.rollout.max_unavailable == 0:
        raise ConfigError(
            source,
            "max_surge and max_unavailable cannot both be 0: a rollout could never start",
            f"{where}.rollout",
        )
    engine_args, env = tuple(profile.engine_args), dict(profile.env)
    if profile.lora is not None:
        lora_args, lora_env = lora_launch(
            profile.engine, profile.lora.max_loras, profile.lora.max_rank, source, where
        )
        engine_args += lora_args
        env.update(lora_env)
    return ProfileSpec(
        model=model,
        name=name,
        engine=profile.engine,
        model_ref=profile.model_ref or model,
        engine_args=engine_args,
        env=tuple(sorted(env.items())),
        gpus_per_node=profile.gpus_per_node,
        cpu_threads=profile.cpu_threads,
        nodes=profile.nodes,
        gpu_name=profile.gpu.name or "*",
        min_memory_bytes=min_memory,
        same_label=profile.same_label,
        replicas=low,
        served_model_names=served,
        weight=profile.weight,
        load_timeout=float(profile.load_timeout),
        min_replicas=low,
        max_replicas=high,
        autoscale_metric=a.metric,
        autoscale_target=float(a.target),
        up_after=float(a.up_after),
        down_after=float(a.down_after),
        idle_after=float(profile.idle_after),
        max_surge=profile.rollout.max_surge,
        max_unavailable=profile.rollout.max_unavailable,
        min_ready=float(profile.rollout.min_ready),
        max_loras=profile.lora.max_loras if profile.lora is not None else 0,
        lora_min_idle=float(profile.lora.min_idle) if profile.lora is not None else 10.0,
        spread=spread,
    )
