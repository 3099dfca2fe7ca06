"""What a local model's files say about a shard before the engine spends minutes on it.

Pure: the files come through ``read_text`` and ``file_sizes`` (the validation probes).
Two checks, each with its arithmetic in the reason:
- ``--max-model-len`` (vLLM) or ``--context-length`` (SGLang) against the model's
  ``config.json`` (``max_position_embeddings``, scaled by ``rope_scaling.factor``);
- the weights' size (the safetensors index's ``total_size``, else the ``*.safetensors``
  or ``.gguf`` files) split over the shard's GPUs against what the engine may use of each
  (``--gpu-memory-utilization`` for vLLM, ``--mem-fraction-static`` for SGLang, of the
  GPU's total, and no more than is free now).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping

from llmgw_proto import v1

from llmgw_agent.adapters import Adapter
from llmgw_agent.engine_flags import ParsedArgs

__all__ = ["context_tokens", "memory_problems", "weights_bytes"]

_GIB = 1024**3
# The engines' own defaults for the share of each GPU they take.
_DEFAULT_FRACTION = {"vllm": ("--gpu-memory-utilization", 0.9)}
_DEFAULT_FRACTION["sglang"] = ("--mem-fraction-static", 0.88)
_CONTEXT_FLAG = {"vllm": "--max-model-len", "sglang": "--context-length"}


def context_tokens(value: str) -> int | None:
    """vLLM's human-readable token counts: 4096, 32k (1000s), 32K (1024s), 1m, 1M."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]?)", value.strip())
    if not match:
        return None
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
    return int(float(match.group(1)) * scale[match.group(2)])


def weights_bytes(
    model_ref: str,
    read_text: Callable[[str], str | None],
    file_sizes: Callable[[str], dict[str, int]],
) -> int | None:
    """The size of the model's weights, or None when there is nothing to measure."""
    if model_ref.endswith(".gguf"):
        sizes = file_sizes(model_ref)
        return sum(sizes.values()) or None
    index = read_text(model_ref.rstrip("/") + "/model.safetensors.index.json")
    if index:
        try:
            total = json.loads(index).get("metadata", {}).get("total_size")
        except (ValueError, AttributeError):
            total = None
        if isinstance(total, int) and total > 0:
            return total
    sizes = file_sizes(model_ref)
    total = sum(v for k, v in sizes.items() if k.endswith((".safetensors", ".gguf")))
    return total or None


def _max_positions(config: Mapping[str, object]) -> int | None:
    for holder in (config, config.get("text_config")):
        if not isinstance(holder, Mapping):
            continue
        for key in ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length"):
            value = holder.get(key)
            if isinstance(value, int) and value > 0:
                rope = holder.get("rope_scaling")
                factor = rope.get("factor") if isinstance(rope, Mapping) else None
                if isinstance(factor, int | float) and factor > 1:
                    return int(value * factor)
                return value
    return None


def _context_problem(
    start: v1.StartShard,
    adapter: Adapter,
    parsed: ParsedArgs,
    read_text: Callable[[str], str | None],
) -> list[str]:
    flag = _CONTEXT_FLAG.get(adapter.name)
    raw = parsed.first(flag) if flag else None
    if raw is None or flag is None or start.model_ref.endswith(".gguf"):
        return []
    if start.env.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") == "1":
        return []  # the operator asked vLLM to allow it
    wanted = context_tokens(raw)
    path = start.model_ref.rstrip("/") + "/config.json"
    text = read_text(path)
    if wanted is None or not text:
        return []
    try:
        config = json.loads(text)
    except ValueError:
        return [f"{path} is not valid JSON"]
    limit = _max_positions(config) if isinstance(config, dict) else None
    if limit is not None and wanted > limit:
        return [
            f"engine_args: {flag} {raw} ({wanted} tokens) is more than the model allows: "
            f"{limit} tokens (max_position_embeddings in {path})"
        ]
    return []


def memory_problems(
    start: v1.StartShard,
    adapter: Adapter,
    parsed: ParsedArgs,
    gpus: int,
    gpu_memory: Mapping[int, tuple[int, int]],
    read_text: Callable[[str], str | None],
    file_sizes: Callable[[str], dict[str, int]],
) -> list[str]:
    problems = _context_problem(start, adapter, parsed, read_text)
    fraction_flag, default = _DEFAULT_FRACTION.get(adapter.name, ("", 0.0))
    known = [gpu_memory[i] for i in start.gpu_indices if i in gpu_memory]
    if not fraction_flag or not known or len(known) != len(start.gpu_indices) or gpus < 1:
        return problems
    raw = parsed.first(fraction_flag)
    try:
        fraction = float(raw) if raw is not None else default
    except ValueError:
        return [*problems, f"engine_args: {fraction_flag} {raw!r} is not a number"]
    total = weights_bytes(start.model_ref, read_text, file_sizes)
    if total is None:
        return problems
    per_gpu = total / gpus
    # The engine may use `fraction` of the GPU's memory, and no more than is free now.
    usable = min(min(t * fraction for t, _ in known), min(f for _, f in known))
    if per_gpu > usable:
        gpu_total, gpu_free = min(known, key=lambda m: min(m[0] * fraction, m[1]))
        problems.append(
            f"the weights ({total / _GIB:.1f} GiB) over {gpus} GPUs need "
            f"{per_gpu / _GIB:.1f} GiB per GPU, but a GPU gives the engine at most "
            f"{usable / _GIB:.1f} GiB ({fraction_flag} {fraction:g} x "
            f"{gpu_total / _GIB:.1f} GiB = {gpu_total * fraction / _GIB:.1f} GiB, "
            f"{gpu_free / _GIB:.1f} GiB free), before any KV cache"
        )
    return problems
