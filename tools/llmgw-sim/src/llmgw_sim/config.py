"""From an engine's parsed flags to one engine-neutral configuration."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from llmgw_sim.flags import EngineKind, resolve_version
from llmgw_sim.knobs import Knobs


class StartupError(Exception):
    """The engine refuses to start; ``exc`` and message mimic the real engine's."""

    def __init__(self, exc: str, message: str, *, phase: str = "config") -> None:
        super().__init__(message)
        self.exc = exc
        self.message = message
        self.phase = phase


@dataclass
class EngineConfig:
    kind: EngineKind
    model: str
    served_names: list[str]
    host: str
    port: int
    api_keys: list[str]
    max_model_len: int
    max_num_seqs: int
    block_size: int
    prefix_caching: bool
    metrics_enabled: bool
    version: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    dp_local: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    headless: bool = False
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    base_gpu_id: int = 0
    memory_fraction: float | None = None
    seed: int = 0
    # The step scheduler's token budget per step (vLLM --max-num-batched-tokens, SGLang
    # --chunked-prefill-size, llama.cpp -b) and KV-cache size in tokens.
    max_num_batched_tokens: int = 8192
    kv_tokens: int = 131072
    # --kv-events-config as given (vLLM, SGLang).
    kv_events_config: str | None = None
    # vLLM --tokenizer: a Hugging Face tokenizer folder. Prompts are then that tokenizer's
    # token ids (chat rendered by its template as llmgw-router renders it, which the
    # real-vLLM tests hold to vLLM's own), and KV events carry them.
    tokenizer: str | None = None
    request_id_headers: bool = False
    # LoRA adapters served next to the base model: name -> path.
    lora_modules: dict[str, str] = field(default_factory=dict)
    # SGLang --disaggregation-mode (null, prefill, decode) and a prefill engine's
    # --disaggregation-bootstrap-port (llmgw_sim.bootstrap).
    disaggregation_mode: str = "null"
    bootstrap_port: int = 8998
    lora_enabled: bool = False
    max_loras: int = 1
    # vLLM serves /v1/(un)load_lora_adapter only with VLLM_ALLOW_RUNTIME_LORA_UPDATING set.
    runtime_lora_updating: bool = False
    non_default_args: dict[str, object] = field(default_factory=dict)
    knobs: Knobs = field(default_factory=Knobs)

    @property
    def primary_name(self) -> str:
        return self.served_names[0]

    @property
    def gpus_needed(self) -> int:
        """Devices this node's ranks use."""
        world = self.tp * self.pp
        per_node = max(1, world // self.nnodes) if self.nnodes > 1 else world
        if self.dp_local is not None:
            dp_here = self.dp_local
        elif self.nnodes > 1:
            dp_here = max(1, self.dp // self.nnodes)
        else:
            dp_here = self.dp
        return per_node * dp_here


# KV cache when nothing sets it: the simple scheduler's historical 128 Ki tokens; the step
# scheduler's is what vLLM reports for an 8B bf16 model (128 KiB per token) on an 80 GB
# H100 at --gpu-memory-utilization 0.9: 72 GiB - 16 GiB weights - ~4 GiB activations.
KV_TOKENS_SIMPLE = 131072
KV_TOKENS_STEP = 425984


def kv_tokens(
    knobs: Knobs,
    block_size: int,
    *,
    blocks: int | None = None,
    memory_bytes: int | None = None,
    tokens: int | None = None,
) -> int:
    """The KV cache in tokens, whole blocks: the engine's own flag first, then the knob."""
    if blocks:
        return blocks * block_size
    if memory_bytes:
        return max(1, memory_bytes // knobs.kv_bytes_per_token // block_size) * block_size
    if tokens:
        return tokens
    if knobs.kv_cache_tokens is not None:
        return knobs.kv_cache_tokens
    return KV_TOKENS_STEP if knobs.scheduler == "step" else KV_TOKENS_SIMPLE


def _positive(name: str, value: int | float | None) -> None:
    if value is not None and value <= 0:
        raise StartupError("ValueError", f"{name} must be a positive number, got {value}")


def from_args(
    kind: EngineKind,
    ns: argparse.Namespace,
    knobs: Knobs,
    environ: Mapping[str, str] | None = None,
) -> EngineConfig:
    """Build the configuration; raises StartupError the way the engine's own checks would."""
    non_default = dict(getattr(ns, "non_default_args", {}))
    # The version whose help the command line was parsed with (--sim-version, or the newest).
    version = resolve_version(kind, knobs.version)
    if kind == "vllm":
        flag = (environ or {}).get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "")
        runtime_lora = flag.strip().lower() in ("1", "true")
        model = ns.model_tag or ns.model
        names = list(ns.served_model_name or [model])
        for name, value in (
            ("tensor_parallel_size", ns.tensor_parallel_size),
            ("pipeline_parallel_size", ns.pipeline_parallel_size),
            ("data_parallel_size", ns.data_parallel_size),
            ("max_num_seqs", ns.max_num_seqs),
            ("max_model_len", ns.max_model_len),
            ("nnodes", ns.nnodes),
        ):
            _positive(name, value)
        if not 0 < ns.gpu_memory_utilization <= 1:
            raise StartupError(
                "ValueError",
                f"GPU memory utilization must be within (0, 1]. Got {ns.gpu_memory_utilization}.",
            )
        if ns.nnodes > 1 and not 0 <= ns.node_rank < ns.nnodes:
            raise StartupError(
                "ValueError", f"node_rank ({ns.node_rank}) must be in [0, nnodes={ns.nnodes})"
            )
        world = ns.tensor_parallel_size * ns.pipeline_parallel_size
        if ns.nnodes > 1 and world % ns.nnodes:
            raise StartupError(
                "ValueError",
                f"world_size ({world}) must be divisible by nnodes ({ns.nnodes}) "
                "for multi-node multiprocessing.",
            )
        block = knobs.block_size or ns.block_size or 16
        _positive("max_num_batched_tokens", getattr(ns, "max_num_batched_tokens", None))
        _positive("num_gpu_blocks_override", getattr(ns, "num_gpu_blocks_override", None))
        return EngineConfig(
            kind=kind,
            model=model,
            served_names=names,
            # vLLM 0.32's online-serving defaults on an H100-class GPU.
            max_num_batched_tokens=getattr(ns, "max_num_batched_tokens", None) or 8192,
            kv_events_config=getattr(ns, "kv_events_config", None),
            tokenizer=getattr(ns, "tokenizer", None),
            kv_tokens=kv_tokens(
                knobs,
                block,
                blocks=getattr(ns, "num_gpu_blocks_override", None),
                memory_bytes=getattr(ns, "kv_cache_memory_bytes", None),
            ),
            host=ns.host or "0.0.0.0",
            port=ns.port,
            # --api-key wins over VLLM_API_KEY, as in vLLM's api_server. LLMGW_SIM_OPEN=1:
            # no key at all (benchmarks whose peer routers cannot know the agent's keys).
            api_keys=[]
            if (environ or {}).get("LLMGW_SIM_OPEN") == "1"
            else [k for k in (ns.api_key or [(environ or {}).get("VLLM_API_KEY", "")]) if k],
            max_model_len=ns.max_model_len or 32768,
            max_num_seqs=ns.max_num_seqs or 1024,
            block_size=block,
            prefix_caching=ns.enable_prefix_caching is not False,
            metrics_enabled=True,
            version=version,
            tp=ns.tensor_parallel_size,
            pp=ns.pipeline_parallel_size,
            dp=ns.data_parallel_size,
            dp_local=ns.data_parallel_size_local,
            nnodes=ns.nnodes,
            node_rank=ns.node_rank,
            headless=ns.headless,
            master_addr=ns.master_addr,
            master_port=ns.master_port,
            memory_fraction=ns.gpu_memory_utilization,
            seed=ns.seed,
            request_id_headers=ns.enable_request_id_headers,
            lora_modules=parse_lora_modules(ns.lora_modules or []),
            lora_enabled=bool(ns.enable_lora or ns.lora_modules),
            max_loras=ns.max_loras,
            runtime_lora_updating=runtime_lora,
            non_default_args=non_default,
            knobs=knobs,
        )
    if kind == "sglang":
        for name, value in (
            ("tp_size", ns.tensor_parallel_size),
            ("pp_size", ns.pipeline_parallel_size),
            ("dp_size", ns.data_parallel_size),
            ("max_running_requests", ns.max_running_requests),
            ("context_length", ns.context_length),
            ("nnodes", ns.nnodes),
            ("page_size", ns.page_size),
        ):
            _positive(name, value)
        lora_paths = parse_lora_modules(ns.lora_paths or [])
        lora = bool(ns.enable_lora or lora_paths)
        if lora and not lora_paths and (ns.max_lora_rank is None or not ns.lora_target_modules):
            # SGLang's own check (server_args): it sizes its LoRA pool from these.
            raise StartupError(
                "ValueError",
                "When no initial --lora-paths is provided, you need to specify both "
                "--max-lora-rank and --lora-target-modules for LoRA initialization.",
            )
        if ns.mem_fraction_static is not None and not 0 < ns.mem_fraction_static < 1:
            raise StartupError(
                "ValueError", f"mem_fraction_static must be in (0, 1), got {ns.mem_fraction_static}"
            )
        return EngineConfig(
            kind=kind,
            model=ns.model_path,
            served_names=[ns.served_model_name or ns.model_path],
            host=ns.host,
            port=ns.port,
            api_keys=[ns.api_key] if ns.api_key else [],
            max_model_len=ns.context_length or 32768,
            max_num_seqs=ns.max_running_requests or 256,
            block_size=knobs.block_size or ns.page_size,
            max_num_batched_tokens=_sglang_budget(ns),
            kv_events_config=getattr(ns, "kv_events_config", None),
            kv_tokens=kv_tokens(
                knobs,
                knobs.block_size or ns.page_size,
                tokens=getattr(ns, "max_total_tokens", None),
            ),
            prefix_caching=not ns.disable_radix_cache,
            metrics_enabled=ns.enable_metrics,
            version=version,
            tp=ns.tensor_parallel_size,
            pp=ns.pipeline_parallel_size,
            dp=ns.data_parallel_size,
            nnodes=ns.nnodes,
            node_rank=ns.node_rank,
            base_gpu_id=ns.base_gpu_id,
            memory_fraction=ns.mem_fraction_static,
            seed=ns.random_seed or 0,
            lora_modules=lora_paths,
            lora_enabled=lora,
            max_loras=ns.max_loras_per_batch,
            # SGLang serves /load_lora_adapter whenever LoRA is on.
            runtime_lora_updating=lora,
            disaggregation_mode=ns.disaggregation_mode,
            bootstrap_port=ns.disaggregation_bootstrap_port,
            non_default_args=non_default,
            knobs=knobs,
        )
    # llama-server
    if ns.ctx_size < 0:
        raise StartupError("ValueError", f"invalid ctx-size: {ns.ctx_size}")
    model = ns.model or (ns.hf_repo or "")
    keys: list[str] = []
    # llama.cpp reads --api-key from LLAMA_API_KEY too (the flag wins).
    raw_keys = ns.api_key or (environ or {}).get("LLAMA_API_KEY", "")
    if raw_keys:
        # llama.cpp takes several keys separated by commas.
        keys = [k for k in raw_keys.split(",") if k]
    parallel = ns.parallel if ns.parallel > 0 else 4
    return EngineConfig(
        kind=kind,
        model=model,
        served_names=[ns.alias or model],
        host=ns.host,
        port=ns.port,
        api_keys=keys,
        max_model_len=ns.ctx_size or 4096,
        max_num_seqs=parallel,
        block_size=knobs.block_size or 16,
        # n_batch is the most tokens one llama_decode takes; -c cells are shared by the slots.
        max_num_batched_tokens=max(1, getattr(ns, "batch_size", 2048) or 2048),
        kv_tokens=kv_tokens(knobs, knobs.block_size or 16, tokens=ns.ctx_size or None),
        prefix_caching=True,
        metrics_enabled=ns.metrics,
        version=version,
        seed=ns.seed if ns.seed >= 0 else 0,
        non_default_args=non_default,
        knobs=knobs,
    )


def _sglang_budget(ns: argparse.Namespace) -> int:
    """SGLang's prefill chunk (--chunked-prefill-size; -1 disables chunking, then a whole
    prompt of up to --max-prefill-tokens goes in one step)."""
    chunk = getattr(ns, "chunked_prefill_size", None)
    if chunk is None:
        return 8192
    if chunk <= 0:
        return max(1, getattr(ns, "max_prefill_tokens", 16384) or 16384)
    return int(chunk)


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    """vLLM's --lora-modules: ``name=path`` or ``{"name": ..., "path": ...}`` items."""
    out: dict[str, str] = {}
    for item in items:
        if not item:
            continue
        if "=" in item and "," not in item and not item.lstrip().startswith("{"):
            name, _, path = item.partition("=")
        else:
            try:
                spec = json.loads(item)
            except json.JSONDecodeError:
                raise StartupError(
                    "ValueError", f"Invalid JSON format for --lora-modules: {item}"
                ) from None
            if not isinstance(spec, dict) or not {"name", "path"} <= spec.keys():
                raise StartupError(
                    "ValueError", f"Invalid fields for --lora-modules: {item} (need name, path)"
                )
            name, path = str(spec["name"]), str(spec["path"])
        out[name] = path
    return out


def visible_devices(environ: Mapping[str, str], default_count: int) -> tuple[int, str | None]:
    """(number of visible GPUs, the CUDA_VISIBLE_DEVICES value or None when unset)."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return default_count, None
    return len([d for d in value.split(",") if d.strip()]), value


def check_devices(config: EngineConfig, environ: Mapping[str, str]) -> None:
    """Fail like the engine does when its GPUs are not what its flags ask for."""
    if config.kind == "llama-server":
        return  # llama.cpp falls back to whatever devices (or the CPU) it finds.
    count, raw = visible_devices(environ, config.knobs.num_gpus)
    needed = config.gpus_needed
    if config.kind == "sglang":
        last = config.base_gpu_id + needed
        if count == 0:
            raise StartupError("RuntimeError", "No CUDA GPUs are available", phase="load")
        if last > count or (raw is not None and needed != count):
            raise StartupError(
                "RuntimeError",
                "CUDA error: invalid device ordinal (tp_size*pp_size*dp_size="
                f"{needed} GPUs from base_gpu_id {config.base_gpu_id}, "
                f"{count} visible; CUDA_VISIBLE_DEVICES={raw})",
                phase="load",
            )
        return
    if count == 0:
        raise StartupError("RuntimeError", "No CUDA GPUs are available")
    if needed > count:
        raise StartupError(
            "ValueError",
            f"World size ({needed}) is larger than the number of available GPUs ({count}) in "
            "this node. If this is intentional and you are using:\n"
            "- ray, set '--distributed-executor-backend ray'.\n"
            "- multiprocessing, set '--nnodes' appropriately.",
        )
    if raw is not None and needed != count:
        # Real vLLM would quietly leave GPUs idle; the simulator refuses so a
        # placement bug (devices handed out but not used) cannot go unnoticed.
        raise StartupError(
            "ValueError",
            f"World size ({needed}) does not match the number of visible GPUs ({count}): "
            f"CUDA_VISIBLE_DEVICES={raw} (llmgw-sim requires an exact match)",
        )


def check_memory(config: EngineConfig) -> None:
    knobs = config.knobs
    total = knobs.gpu_memory_gib
    free = knobs.free_memory_fraction * total
    if config.kind == "vllm":
        util = config.memory_fraction or 0.9
        if knobs.free_memory_fraction < util:
            raise StartupError(
                "ValueError",
                f"Free memory on device cuda:0 ({free:.2f}/{total:.2f} GiB) on startup is less "
                f"than desired GPU memory utilization ({util}, {util * total:.2f} GiB). "
                "Decrease GPU memory utilization or reduce GPU memory used by other processes.",
                phase="load",
            )
    elif config.kind == "sglang":
        frac = config.memory_fraction or 0.88
        if knobs.free_memory_fraction < frac:
            raise StartupError(
                "RuntimeError",
                f"Not enough memory. avail mem={free:.2f} GB, mem_fraction_static={frac}. "
                "Please try to increase --mem-fraction-static.",
                phase="load",
            )


def check_kv_fits(config: EngineConfig) -> None:
    """vLLM refuses to start when one request of --max-model-len cannot fit its KV cache
    (checked with the step scheduler, whose cache is the engine's real limit)."""
    if config.kind != "vllm" or config.knobs.scheduler != "step":
        return
    if config.max_model_len <= config.kv_tokens:
        return
    per_token = config.knobs.kv_bytes_per_token
    gib = 1 << 30

    def fmt(b: int) -> str:
        return f"{round(b / gib, 2)}"

    raise StartupError(
        "ValueError",
        f"To serve at least one request with the model's max seq len ({config.max_model_len}), "
        f"({fmt(config.max_model_len * per_token)} GiB KV cache is needed, which is larger "
        f"than the available KV cache memory ({fmt(config.kv_tokens * per_token)} GiB). "
        "Based on the available memory, the estimated maximum model length is "
        f"{config.kv_tokens}. Try increasing `gpu_memory_utilization` (which also controls "
        "CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the "
        "engine. See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for "
        "more details.",
        phase="load",
    )
