"""Disaggregated profiles (issue 32): a profile's ``prefill:`` and ``decode:`` pools.

A profile that declares both pools becomes two catalog profiles, ``<name>-prefill`` and
``<name>-decode``, each with its pool's replicas, GPUs per node, nodes and extra
engine arguments (after the profile's), marked with its role, the profile they came
from and the node label whose value both pools' nodes share (``fabric_label``). The
connector flags are the agent's to set from the role, so a profile may not set them.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import msgspec
from llmgw_proto.config import ConfigError

if TYPE_CHECKING:
    from llmgw_control.catalog import ProfileConfig, ProfileSpec

__all__ = ["CONNECTOR_FLAGS", "ROLES", "pd_pools", "pool_name", "with_role"]

ROLES = ("prefill", "decode")

# What the agent sets from a pool's role (llmgw_agent.disagg); a profile may not. (SGLang's
# --disaggregation-transfer-backend and --disaggregation-ib-device the agent sets only
# where the profile does not.)
CONNECTOR_FLAGS: dict[str, frozenset[str]] = {
    "vllm": frozenset({"--kv-transfer-config", "--kv_transfer_config"}),
    "sglang": frozenset({"--disaggregation-mode", "--disaggregation-bootstrap-port"}),
    "llamacpp": frozenset(),
}


def pool_name(profile: str, role: str) -> str:
    """The catalog profile one pool of a disaggregated profile becomes."""
    return f"{profile}-{role}"


def pd_pools(
    name: str, profile: ProfileConfig, names: set[str], source: str, where: str
) -> list[tuple[str, str, ProfileConfig]]:
    """(role, pool profile name, its config) for each pool; [] for an aggregated profile.

    Raises a ConfigError naming the field for what a disaggregated profile cannot be.
    """
    if profile.prefill is None and profile.decode is None:
        if profile.fabric_label:
            raise ConfigError(
                source,
                "fabric_label is for disaggregated profiles (with prefill: and decode: pools)",
                f"{where}.fabric_label",
            )
        return []
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        if getattr(profile, role) is None:
            raise ConfigError(
                source,
                f"a disaggregated profile needs both pools: {other} is set but {role} is not",
                f"{where}.{role}",
            )
    if profile.engine == "llamacpp":
        raise ConfigError(
            source,
            "llama.cpp has no prefill/decode disaggregation: use vllm or sglang",
            f"{where}.engine",
        )
    label = profile.fabric_label.strip()
    if not label:
        raise ConfigError(
            source,
            "a disaggregated profile needs fabric_label: the node label whose value both "
            "pools share, e.g. fabric.ib-subnet",
            f"{where}.fabric_label",
        )
    if profile.lora is not None:
        raise ConfigError(
            source, "LoRA adapters are not served by disaggregated profiles", f"{where}.lora"
        )
    reserved = CONNECTOR_FLAGS[profile.engine]
    for j, arg in enumerate(profile.engine_args):
        if arg.split("=", 1)[0] in reserved:
            raise ConfigError(
                source,
                f"{arg.split('=', 1)[0]} is set by the agent from each pool's role",
                f"{where}.engine_args[{j}]",
            )
    pools: list[tuple[str, str, ProfileConfig]] = []
    for role in ROLES:
        pool = getattr(profile, role)
        at = f"{where}.{role}"
        pname = pool_name(name, role)
        if pname in names:
            raise ConfigError(
                source,
                f"profile {pname!r} is already defined: the {role} pool of {name!r} is named so",
                at,
            )
        for j, arg in enumerate(pool.engine_args):
            if not arg:
                raise ConfigError(
                    source, "an engine argument must not be empty", f"{at}.engine_args[{j}]"
                )
            if arg.split("=", 1)[0] in reserved:
                raise ConfigError(
                    source,
                    f"{arg.split('=', 1)[0]} is set by the agent from the pool's role",
                    f"{at}.engine_args[{j}]",
                )
        replicas = pool.replicas
        if not isinstance(replicas, int) and replicas.min > replicas.max:
            raise ConfigError(
                source,
                f"min ({replicas.min}) must not exceed max ({replicas.max})",
                f"{at}.replicas",
            )
        gpus = profile.gpus_per_node if pool.gpus_per_node is None else pool.gpus_per_node
        nodes = profile.nodes if pool.nodes is None else pool.nodes
        if nodes > 1 and gpus == 0:
            raise ConfigError(source, "a multi-node pool needs gpus_per_node >= 1", f"{at}.nodes")
        if profile.same_label and nodes == 1:
            raise ConfigError(
                source,
                "same_label only applies to multi-node pools (nodes >= 2)",
                f"{at}.nodes",
            )
        config = msgspec.structs.replace(
            profile,
            replicas=replicas,
            gpus_per_node=gpus,
            nodes=nodes,
            engine_args=[*profile.engine_args, *pool.engine_args],
            prefill=None,
            decode=None,
            fabric_label="",
        )
        pools.append((role, pname, config))
    return pools


def with_role(spec: ProfileSpec, role: str, group: str, profile: ProfileConfig) -> ProfileSpec:
    """``spec`` marked as the ``role`` pool of profile ``group``."""
    return dataclasses.replace(
        spec, role=role, pd_group=group, fabric_label=profile.fabric_label.strip()
    )
