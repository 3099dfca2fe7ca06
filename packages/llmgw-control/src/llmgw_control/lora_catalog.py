"""LoRA adapters in the catalog (issue 30): the checks and the engines' flags.

A model lists its adapters (``adapters: [{name, source}]``); a profile that serves them
says how many the engine holds at once and their largest rank (``lora: {max_loras,
max_rank}``), which become the engine's own flags here. The agent checks those flags
against the engine's help like every other argument before it launches the engine.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from llmgw_proto.config import ConfigError

__all__ = ["VLLM_RANKS", "AdapterSpec", "check_adapters", "lora_launch"]

# vLLM's --max-lora-rank takes one of these (its help's choices).
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$")
# The engines load adapters at runtime through these flags and this environment.
RUNTIME_ENV = {"vllm": (("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True"),)}


@dataclass(frozen=True)
class AdapterSpec:
    """One LoRA adapter of a model: the name requests use as `model`, and what to load."""

    model: str
    name: str
    source: str


def lora_launch(
    engine: str, max_loras: int, max_rank: int, source: str, where: str
) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """The engine arguments and environment for LoRA with these limits (runtime loading)."""
    if engine == "vllm":
        if max_rank not in VLLM_RANKS:
            raise ConfigError(
                source,
                f"vLLM's --max-lora-rank takes one of {', '.join(map(str, VLLM_RANKS))} "
                f"(got {max_rank})",
                f"{where}.lora.max_rank",
            )
        args: tuple[str, ...] = (
            "--enable-lora",
            "--max-loras",
            str(max_loras),
            "--max-lora-rank",
            str(max_rank),
        )
        return args, RUNTIME_ENV["vllm"]
    if engine == "sglang":
        # Without --lora-paths at start SGLang needs the target modules to size its pool.
        args = (
            "--enable-lora",
            "--max-loras-per-batch",
            str(max_loras),
            "--max-lora-rank",
            str(max_rank),
            "--lora-target-modules",
            "all",
        )
        return args, ()
    raise ConfigError(
        source,
        "llama-server loads LoRA adapters only at start (--lora) and selects them per "
        "request by id, not by model name: LoRA adapters are served by vllm and sglang "
        "profiles",
        f"{where}.lora",
    )


def check_adapters(
    model: str,
    adapters: Sequence[tuple[str, str]],
    has_lora: bool,
    names: Mapping[str, str],
    source: str,
    where: str,
    sglang: bool = False,
) -> list[AdapterSpec]:
    """A model's adapters checked: plain unique names that no model serves, a source each,
    and a profile that loads adapters. ``names`` maps every name taken so far to what
    takes it (served model names and adapters of earlier models). ``sglang``: an SGLang
    profile serves them, and SGLang reads a request's `model` of ``base:adapter`` as that
    adapter, so an adapter's name has no ``:``."""
    out: list[AdapterSpec] = []
    if adapters and not has_lora:
        raise ConfigError(
            source,
            f"model {model!r} lists adapters but none of its profiles sets lora "
            "(lora: {max_loras, max_rank}) to serve them",
            f"{where}.adapters",
        )
    seen: dict[str, int] = {}
    for j, (name, src) in enumerate(adapters):
        at = f"{where}.adapters[{j}]"
        if not _ADAPTER_NAME.match(name):
            raise ConfigError(
                source,
                f"adapter name {name!r} must start with a letter or digit and contain no "
                "spaces (letters, digits and . _ : / @ + -)",
                f"{at}.name",
            )
        if sglang and ":" in name:
            raise ConfigError(
                source,
                f"adapter name {name!r} has a ':', and an sglang profile of model {model!r} "
                "serves it: SGLang reads a request's model 'base:adapter' as the adapter "
                "after the ':', so the name must not contain one",
                f"{at}.name",
            )
        if name in seen:
            raise ConfigError(
                source,
                f"adapter {name!r} is already listed at {where}.adapters[{seen[name]}]",
                f"{at}.name",
            )
        owner = names.get(name)
        if owner is not None:
            raise ConfigError(
                source,
                f"adapter name {name!r} is already taken by {owner}; requests name an "
                "adapter as their model, so the name must pick one",
                f"{at}.name",
            )
        if not src.strip():
            raise ConfigError(
                source,
                "an adapter needs a source: a path on the nodes or a hub id",
                f"{at}.source",
            )
        seen[name] = j
        out.append(AdapterSpec(model, name, src))
    return out
