"""The model catalog: what should run, and every check of it in one place.

The config file declares models, each with named profiles (how to run it: engine,
arguments, GPUs per node, nodes per replica, constraints, replicas wanted). The
schema below rejects wrong types; :func:`build_catalog` rejects what types cannot
say, naming the file and field like every other config error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Literal

import msgspec
from llmgw_proto.config import BaseConfig, ConfigError, Duration
from llmgw_proto.sizes import parse_size

__all__ = [
    "Catalog",
    "GpuConstraint",
    "ModelConfig",
    "ProfileConfig",
    "ProfileSpec",
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
    replicas: NonNegative = 1
    served_model_names: list[str] = []
    weight: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 1
    load_timeout: Duration = Duration(600.0)


class ModelConfig(BaseConfig):
    name: str
    profiles: dict[str, ProfileConfig] = {}


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
    replicas: int
    served_model_names: tuple[str, ...]
    weight: int
    load_timeout: float

    @property
    def key(self) -> tuple[str, str]:
        return (self.model, self.name)


@dataclass(frozen=True)
class Catalog:
    """Every profile of every model, in config order."""

    profiles: tuple[ProfileSpec, ...] = ()
    _by_key: dict[tuple[str, str], ProfileSpec] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        self._by_key.update({p.key: p for p in self.profiles})

    def get(self, model: str, profile: str) -> ProfileSpec | None:
        return self._by_key.get((model, profile))

    def models(self) -> list[str]:
        return list(dict.fromkeys(p.model for p in self.profiles))

    def of_model(self, model: str) -> list[ProfileSpec]:
        return [p for p in self.profiles if p.model == model]


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
            spec = _check_profile(model.name, name, profile, source, f"{where}.profiles.{name}")
            for served in spec.served_model_names:
                owner = served_by.setdefault(served, model.name)
                if owner != model.name:
                    raise ConfigError(
                        source,
                        f"served model name {served!r} is already served by model {owner!r}; "
                        "a name must pick one model",
                        f"{where}.profiles.{name}.served_model_names",
                    )
            profiles.append(spec)
    return Catalog(tuple(profiles))


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
    return ProfileSpec(
        model=model,
        name=name,
        engine=profile.engine,
        model_ref=profile.model_ref or model,
        engine_args=tuple(profile.engine_args),
        env=tuple(sorted(profile.env.items())),
        gpus_per_node=profile.gpus_per_node,
        cpu_threads=profile.cpu_threads,
        nodes=profile.nodes,
        gpu_name=profile.gpu.name or "*",
        min_memory_bytes=min_memory,
        same_label=profile.same_label,
        replicas=profile.replicas,
        served_model_names=served,
        weight=profile.weight,
        load_timeout=float(profile.load_timeout),
    )
