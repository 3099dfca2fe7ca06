"""Simulation knobs: ``--sim-*`` flags and ``LLMGW_SIM_*`` environment variables.

They are split off the command line before the engine's own flags are parsed,
so an engine's parser never sees them and they never shadow a real flag.  A flag
beats the environment variable of the same name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

ENV_PREFIX = "LLMGW_SIM_"
FLAG_PREFIX = "--sim-"


class KnobError(ValueError):
    """A ``--sim-*`` flag or ``LLMGW_SIM_*`` variable is wrong; the message names it."""


@dataclass
class Knobs:
    """Every simulation knob, with its default.  Times are seconds."""

    load_time: float = 0.0
    load_until: str | None = None
    ttft: float = 0.0
    itl: float = 0.0
    prefill_per_token: float = 0.0
    ttft_std_dev: float = 0.0
    itl_std_dev: float = 0.0
    time_factor_under_load: float = 1.0
    output_len: int | None = None
    default_max_tokens: int = 16
    mode: str = "random"
    seed: int = 0
    kv_cache_tokens: int | None = None
    scheduler: str = "simple"
    prefill_rate: float = 20000.0
    step_time: float = 0.008
    decode_seq_time: float = 0.0001
    kv_bytes_per_token: int = 131072
    block_size: int | None = None
    num_gpus: int = 8
    gpu_memory_gib: float = 80.0
    free_memory_fraction: float = 1.0
    fail_on_load: str | None = None
    exit_code: int = 1
    crash_after_requests: int | None = None
    crash_after_seconds: float | None = None
    crash_message: str = "CUDA error: an illegal memory access was encountered"
    error_rate: float = 0.0
    error_status: int = 500
    error_types: str = ""
    stall_after_tokens: int | None = None
    shutdown_grace: float = 30.0
    embedding_dim: int = 32
    version: str | None = None
    log_requests: bool = False
    name: str | None = None
    script_routes: bool = False
    lora_load_time: float = 0.0
    kv_transfer_per_token: float = 0.0
    bootstrap_timeout: float = 5.0


# Knobs that are switches take no value on the command line.
_SWITCHES = frozenset({"log_requests", "script_routes"})
_HELP: dict[str, str] = {
    "load_time": "seconds spent 'loading the model' before the engine is ready",
    "load_until": "also keep loading until this file exists (lets tests and demos decide)",
    "ttft": "base time to first token, seconds",
    "itl": "inter-token latency, seconds",
    "prefill_per_token": "extra time to first token per prompt token not found in the prefix cache",
    "ttft_std_dev": "standard deviation of time to first token (kept within 30-170% of it)",
    "itl_std_dev": "standard deviation of inter-token latency (kept within 30-170% of it)",
    "time_factor_under_load": "times stretch up to this factor as batch slots fill (>= 1)",
    "output_len": "tokens to generate (capped by the request's max_tokens)",
    "default_max_tokens": "tokens to generate when neither the request nor --sim-output-len says",
    "mode": "response text: 'random' (seeded words) or 'echo' (repeat the prompt)",
    "seed": "seed for generated text and --sim-error-rate",
    "kv_cache_tokens": "simulated KV cache size in tokens (default 131072; 425984 with "
    "--sim-scheduler step; the engine's own KV flags win)",
    "scheduler": "'simple' (per-request delays from --sim-ttft/--sim-itl/"
    "--sim-prefill-per-token) or 'step' (an engine step loop: token budget per step shared "
    "by prefill chunks and decodes, a finite block KV cache with prefix caching)",
    "prefill_rate": "step scheduler: prefill tokens computed per second",
    "step_time": "step scheduler: fixed seconds per step (the inter-token latency of a lone "
    "sequence)",
    "decode_seq_time": "step scheduler: extra seconds per step for each decoding sequence",
    "kv_bytes_per_token": "KV-cache bytes per token, to turn --kv-cache-memory-bytes into "
    "blocks (default: Llama-3-8B in bf16)",
    "block_size": "prefix cache block size in tokens (default: the engine's own)",
    "num_gpus": "GPUs on the simulated node when CUDA_VISIBLE_DEVICES is unset",
    "gpu_memory_gib": "memory of each simulated GPU in GiB (for log and error messages)",
    "free_memory_fraction": "fraction of GPU memory free at start-up",
    "fail_on_load": "fail during load with this message",
    "exit_code": "exit code for --sim-fail-on-load and crashes",
    "crash_after_requests": "crash right after completing this many requests",
    "crash_after_seconds": "crash this many seconds after becoming ready",
    "crash_message": "root-cause message printed when crashing",
    "error_rate": "fraction of inference requests answered with --sim-error-status",
    "error_status": "HTTP status used by --sim-error-rate",
    "error_types": "comma-separated failure types for --sim-error-rate instead of one status: "
    "rate_limit, invalid_api_key, context_length, server_error, invalid_request, "
    "model_not_found",
    "stall_after_tokens": "streams stop sending (but stay open) after this many tokens",
    "shutdown_grace": "seconds running requests get to finish after SIGTERM",
    "embedding_dim": "length of the vectors /v1/embeddings returns",
    "version": "engine version to simulate: whose captured help the flags come from, and what "
    "/version reports (default: the newest captured)",
    "log_requests": "log one line per finished request",
    "name": "this engine's name, sent in an X-Sim-Name header on every answer",
    "lora_load_time": "seconds a runtime LoRA adapter load takes (load_lora_adapter)",
    "kv_transfer_per_token": "seconds per prompt token a decode engine spends fetching the KV "
    "cache a prefill engine issued (kv_transfer_params; llmgw_sim.kvtransfer)",
    "bootstrap_timeout": "seconds an SGLang decode engine waits for a prefill engine to "
    "announce a bootstrap room before refusing it (llmgw_sim.bootstrap)",
    "script_routes": "serve /sim/script (scripted failures, health) and /sim/stats (request "
    "counts) for tests",
}
_CHOICES: dict[str, tuple[str, ...]] = {
    "mode": ("random", "echo"),
    "scheduler": ("simple", "step"),
}


def _knob_fields() -> dict[str, type]:
    types: dict[str, type] = {}
    defaults = Knobs()
    for f in fields(Knobs):
        value = getattr(defaults, f.name)
        if f.name in _SWITCHES:
            types[f.name] = bool
        elif f.name in {
            "output_len",
            "crash_after_requests",
            "stall_after_tokens",
            "block_size",
            "kv_cache_tokens",
        }:
            types[f.name] = int
        elif f.name in {"crash_after_seconds"}:
            types[f.name] = float
        elif f.name in {"fail_on_load", "version", "load_until", "name"}:
            types[f.name] = str
        else:
            types[f.name] = type(value)
    return types


KNOB_TYPES: dict[str, type] = _knob_fields()


def knob_flag(name: str) -> str:
    return FLAG_PREFIX + name.replace("_", "-")


def knob_env(name: str) -> str:
    return ENV_PREFIX + name.upper()


def knob_help() -> list[tuple[str, str, str]]:
    """(flag, env var, description) for every knob, for --help and the README."""
    return [(knob_flag(n), knob_env(n), _HELP[n]) for n in KNOB_TYPES]


def split_sim_args(argv: Sequence[str]) -> tuple[list[str], list[tuple[str, str | None]]]:
    """Split ``argv`` into the engine's own arguments and ``(knob flag, value)`` pairs."""
    engine: list[str] = []
    sim: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith(FLAG_PREFIX):
            key, eq, value = arg.partition("=")
            name = key[len(FLAG_PREFIX) :].replace("-", "_")
            if name in _SWITCHES or eq:
                sim.append((key, value if eq else None))
            elif i + 1 < len(argv):
                sim.append((key, argv[i + 1]))
                i += 1
            else:
                sim.append((key, None))
            i += 1
            continue
        engine.append(arg)
        i += 1
    return engine, sim


def _convert(name: str, source: str, raw: str | None) -> object:
    kind = KNOB_TYPES[name]
    if kind is bool:
        if raw is None:
            return True
        lowered = raw.strip().lower()
        if lowered in {"1", "true", "yes", "on"}:
            return True
        if lowered in {"0", "false", "no", "off", ""}:
            return False
        raise KnobError(f"{source}: expected a boolean (1/0, true/false), got {raw!r}")
    if raw is None:
        raise KnobError(f"{source}: expected a value")
    try:
        value: object = kind(raw)
    except ValueError:
        raise KnobError(f"{source}: expected {kind.__name__}, got {raw!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise KnobError(f"{source}: expected a finite number, got {raw!r}")
    if name in _CHOICES and value not in _CHOICES[name]:
        raise KnobError(f"{source}: expected one of {', '.join(_CHOICES[name])}, got {raw!r}")
    return value


_POSITIVE = {
    "kv_cache_tokens",
    "block_size",
    "num_gpus",
    "embedding_dim",
    "gpu_memory_gib",
    "kv_bytes_per_token",
}
_FRACTIONS = {"free_memory_fraction", "error_rate"}


# Named failures (llm-d-inference-sim's failure types): status and message.
FAILURE_TYPES: dict[str, tuple[int, str]] = {
    "rate_limit": (429, "Rate limit reached, please retry later."),
    "invalid_api_key": (401, "Incorrect API key provided."),
    "context_length": (400, "This model's maximum context length was exceeded."),
    "server_error": (503, "The server is overloaded or not ready yet."),
    "invalid_request": (400, "Invalid request: simulated rejection."),
    "model_not_found": (404, "The model does not exist."),
}


def _check(name: str, source: str, value: object) -> None:
    if name == "error_types" and isinstance(value, str):
        unknown = [t for t in value.split(",") if t and t not in FAILURE_TYPES]
        if unknown:
            raise KnobError(
                f"{source}: unknown failure type(s) {', '.join(unknown)}; expected "
                f"{', '.join(FAILURE_TYPES)}"
            )
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    if name in _POSITIVE and value <= 0:
        raise KnobError(f"{source}: must be > 0, got {value}")
    if name in _FRACTIONS and not 0.0 <= value <= 1.0:
        raise KnobError(f"{source}: must be between 0 and 1, got {value}")
    if name == "error_status" and not 400 <= value <= 599:
        raise KnobError(f"{source}: must be an HTTP error status (400-599), got {value}")
    if name == "time_factor_under_load" and value < 1:
        raise KnobError(f"{source}: must be >= 1, got {value}")
    if name == "exit_code" and not 1 <= value <= 255:
        raise KnobError(f"{source}: must be between 1 and 255, got {value}")
    if value < 0:
        raise KnobError(f"{source}: must be >= 0, got {value}")


def load_knobs(
    sim_args: Sequence[tuple[str, str | None]],
    environ: Mapping[str, str],
) -> Knobs:
    """Build :class:`Knobs` from the environment, then the ``--sim-*`` flags."""
    knobs = Knobs()
    setters: list[tuple[str, str, str | None]] = []
    for name in KNOB_TYPES:
        env = knob_env(name)
        if env in environ:
            setters.append((name, env, environ[env]))
    for key, raw in sim_args:
        name = key[len(FLAG_PREFIX) :].replace("-", "_")
        if name not in KNOB_TYPES:
            raise KnobError(f"unknown simulator flag {key} (see 'llmgw-sim --help' for the knobs)")
        setters.append((name, key, raw))
    for name, source, raw in setters:
        value = _convert(name, source, raw)
        _check(name, source, value)
        setattr(knobs, name, value)
    return knobs
