"""Command-line flag tables of the engines the simulator stands in for.

Each engine's flags are data (names, type, default), kept close to the real
engines' own spellings and defaults so that whatever llmgw's adapters emit for
a real engine is accepted here, and anything a real engine would reject is
rejected here too.  Simulation knobs live in :mod:`llmgw_sim.knobs`, never here.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NoReturn

EngineKind = Literal["vllm", "sglang", "llama-server"]
ENGINE_KINDS: tuple[EngineKind, ...] = ("vllm", "sglang", "llama-server")

# "bool" is argparse.BooleanOptionalAction (vLLM's dataclass-derived flags accept
# --x and --no-x); "true" is a plain store_true switch; "list" takes one or more
# values; "hint" is vLLM's human-readable int (e.g. 32k, 1M); "opt" takes an
# optional value (llama.cpp's -fa with or without on/off/auto).
FlagKind = Literal["int", "float", "str", "bool", "true", "list", "append", "hint", "opt"]


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]
    kind: FlagKind
    default: object = None
    choices: tuple[str, ...] | None = None
    required: bool = False

    @property
    def dest(self) -> str:
        long = next((n for n in self.names if n.startswith("--")), self.names[0])
        return long.lstrip("-").replace("-", "_")


def _f(
    names: str,
    kind: FlagKind,
    default: object = None,
    choices: tuple[str, ...] | None = None,
    *,
    required: bool = False,
) -> Flag:
    return Flag(tuple(names.split()), kind, default, choices, required)


def human_readable_int(value: str) -> int:
    """vLLM's size parser for --max-model-len and friends: 4096, 32k, 32K, 1m, 1M."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]?)", value.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"invalid human readable integer: {value!r}")
    number, suffix = match.groups()
    # vLLM reads a lowercase suffix as decimal and an uppercase one as binary.
    scale = {
        "": 1,
        "k": 10**3,
        "m": 10**6,
        "g": 10**9,
        "K": 2**10,
        "M": 2**20,
        "G": 2**30,
    }[suffix]
    result = float(number) * scale
    if not result.is_integer():
        raise argparse.ArgumentTypeError(f"not a whole number of tokens: {value!r}")
    return int(result)


_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")

VLLM_FLAGS: tuple[Flag, ...] = (
    # Frontend (vllm/entrypoints/openai/cli_args.py)
    _f("--headless", "true", False),
    _f("--api-server-count -asc", "int"),
    _f("--config", "str"),
    _f("--grpc", "true", False),
    _f("--host", "str"),
    _f("--port", "int", 8000),
    _f("--uds", "str"),
    _f(
        "--uvicorn-log-level",
        "str",
        "info",
        ("critical", "error", "warning", "info", "debug", "trace"),
    ),
    _f("--disable-uvicorn-access-log", "bool", False),
    _f("--disable-access-log-for-endpoints", "str"),
    _f("--allow-credentials", "bool", False),
    _f("--allowed-origins", "str"),
    _f("--allowed-methods", "str"),
    _f("--allowed-headers", "str"),
    _f("--api-key", "list"),
    _f("--lora-modules", "list"),
    _f("--chat-template", "str"),
    _f("--chat-template-content-format", "str", "auto", ("auto", "string", "openai")),
    _f("--trust-request-chat-template", "bool", False),
    _f("--default-chat-template-kwargs", "str"),
    _f("--response-role", "str", "assistant"),
    _f("--ssl-keyfile", "str"),
    _f("--ssl-certfile", "str"),
    _f("--ssl-ca-certs", "str"),
    _f("--enable-ssl-refresh", "bool", False),
    _f("--ssl-cert-reqs", "int", 0),
    _f("--ssl-ciphers", "str"),
    _f("--root-path", "str"),
    _f("--middleware", "append"),
    _f("--return-tokens-as-token-ids", "bool", False),
    _f("--disable-frontend-multiprocessing", "bool", False),
    _f("--enable-request-id-headers", "bool", False),
    _f("--enable-auto-tool-choice", "bool", False),
    _f("--exclude-tools-when-tool-choice-none", "bool", False),
    _f("--tool-call-parser", "str"),
    _f("--tool-parser-plugin", "str", ""),
    _f("--tool-server", "str"),
    _f("--log-config-file", "str"),
    _f("--max-log-len", "int"),
    _f("--disable-fastapi-docs", "bool", False),
    _f("--enable-prompt-tokens-details", "bool", False),
    _f("--enable-server-load-tracking", "bool", False),
    _f("--enable-force-include-usage", "bool", False),
    _f("--enable-tokenizer-info-endpoint", "bool", False),
    _f("--enable-log-outputs", "bool", False),
    _f("--enable-per-request-metrics", "bool", False),
    _f("--log-error-stack", "bool", False),
    _f("--tokens-only", "bool", False),
    _f("--h11-max-incomplete-event-size", "int", 4194304),
    _f("--h11-max-header-count", "int", 256),
    # Model (vllm/config/model.py via vllm/engine/arg_utils.py)
    _f("--model", "str", "Qwen/Qwen3-0.6B"),
    _f("--runner", "str", "auto", ("auto", "generate", "pooling", "draft")),
    _f("--convert", "str", "auto", ("auto", "none", "embed", "classify", "reward")),
    _f("--task", "str"),
    _f("--tokenizer", "str"),
    _f("--tokenizer-mode", "str", "auto"),
    _f("--trust-remote-code", "bool", False),
    _f("--dtype", "str", "auto", _DTYPES),
    _f("--seed", "int", 0),
    _f("--hf-config-path", "str"),
    _f("--allowed-local-media-path", "str", ""),
    _f("--allowed-media-domains", "list"),
    _f("--revision", "str"),
    _f("--code-revision", "str"),
    _f("--tokenizer-revision", "str"),
    _f("--max-model-len", "hint"),
    _f("--quantization -q", "str"),
    _f("--enforce-eager", "bool", False),
    _f("--max-logprobs", "int", 20),
    _f("--logprobs-mode", "str", "raw_logprobs"),
    _f("--disable-sliding-window", "bool", False),
    _f("--disable-cascade-attn", "bool", False),
    _f("--skip-tokenizer-init", "bool", False),
    _f("--enable-prompt-embeds", "bool", False),
    _f("--served-model-name", "list"),
    _f("--config-format", "str", "auto"),
    _f("--hf-token", "opt"),
    _f("--hf-overrides", "str"),
    _f("--pooler-config", "str"),
    _f("--logits-processor-pattern", "str"),
    _f("--generation-config", "str", "auto"),
    _f("--override-generation-config", "str"),
    _f("--enable-sleep-mode", "bool", False),
    _f("--model-impl", "str", "auto"),
    _f("--override-attention-dtype", "str"),
    _f("--logits-processors", "list"),
    _f("--io-processor-plugin", "str"),
    _f("--rope-scaling", "str"),
    _f("--rope-theta", "float"),
    # Load
    _f("--load-format", "str", "auto"),
    _f("--download-dir", "str"),
    _f("--safetensors-load-strategy", "str", "lazy"),
    _f("--model-loader-extra-config", "str"),
    _f("--ignore-patterns", "list"),
    _f("--use-tqdm-on-load", "bool", True),
    _f("--pt-load-map-location", "str", "cpu"),
    # Structured outputs / reasoning
    _f("--reasoning-parser", "str", ""),
    _f("--guided-decoding-backend", "str"),
    _f("--structured-outputs-config", "str"),
    # Parallel (vllm/config/parallel.py)
    _f("--distributed-executor-backend", "str", None, ("ray", "mp", "uni", "external_launcher")),
    _f("--pipeline-parallel-size -pp", "int", 1),
    _f("--tensor-parallel-size -tp", "int", 1),
    _f("--decode-context-parallel-size -dcp", "int", 1),
    _f("--data-parallel-size -dp", "int", 1),
    _f("--data-parallel-rank -dpn", "int"),
    _f("--data-parallel-start-rank -dpr", "int"),
    _f("--data-parallel-size-local -dpl", "int"),
    _f("--data-parallel-address -dpa", "str"),
    _f("--data-parallel-rpc-port -dpp", "int"),
    _f("--data-parallel-backend -dpb", "str", "mp"),
    _f("--data-parallel-hybrid-lb", "bool", False),
    _f("--data-parallel-external-lb", "bool", False),
    _f("--enable-expert-parallel", "bool", False),
    _f("--enable-dbo", "bool", False),
    _f("--enable-eplb", "bool", False),
    _f("--eplb-config", "str"),
    _f("--expert-placement-strategy", "str", "linear"),
    _f("--max-parallel-loading-workers", "int"),
    _f("--ray-workers-use-nsight", "bool", False),
    _f("--disable-custom-all-reduce", "bool", False),
    _f("--worker-cls", "str", "auto"),
    _f("--worker-extension-cls", "str", ""),
    _f("--nnodes -n", "int", 1),
    _f("--node-rank -r", "int", 0),
    _f("--master-addr", "str", "127.0.0.1"),
    _f("--master-port", "int", 29501),
    # Cache (vllm/config/cache.py)
    _f("--block-size", "int", None, ("1", "8", "16", "32", "64", "128")),
    _f("--gpu-memory-utilization", "float", 0.9),
    _f("--kv-cache-memory-bytes", "hint"),
    _f("--swap-space", "float", 4.0),
    _f("--kv-cache-dtype", "str", "auto"),
    _f("--num-gpu-blocks-override", "int"),
    _f("--enable-prefix-caching", "bool", None),
    _f("--prefix-caching-hash-algo", "str", "sha256"),
    _f("--cpu-offload-gb", "float", 0.0),
    _f("--calculate-kv-scales", "bool", False),
    _f("--kv-sharing-fast-prefill", "bool", False),
    _f("--mamba-cache-dtype", "str", "auto"),
    _f("--kv-offloading-size", "float"),
    _f("--kv-offloading-backend", "str"),
    # Multimodal
    _f("--limit-mm-per-prompt", "str"),
    _f("--mm-processor-kwargs", "str"),
    _f("--mm-processor-cache-gb", "float", 4.0),
    _f("--media-io-kwargs", "str"),
    _f("--interleave-mm-strings", "bool", False),
    _f("--skip-mm-profiling", "bool", False),
    # LoRA
    _f("--enable-lora", "bool", False),
    _f("--max-loras", "int", 1),
    _f("--max-lora-rank", "int", 16),
    _f("--lora-dtype", "str", "auto"),
    _f("--max-cpu-loras", "int"),
    _f("--fully-sharded-loras", "bool", False),
    _f("--default-mm-loras", "str"),
    # Observability
    _f("--show-hidden-metrics-for-version", "str"),
    _f("--otlp-traces-endpoint", "str"),
    _f("--collect-detailed-traces", "list"),
    # Scheduler (vllm/config/scheduler.py)
    _f("--max-num-batched-tokens", "hint"),
    _f("--max-num-seqs", "int"),
    _f("--max-num-partial-prefills", "int", 1),
    _f("--max-long-partial-prefills", "int", 1),
    _f("--long-prefill-token-threshold", "int", 0),
    _f("--cuda-graph-sizes", "list"),
    _f("--scheduling-policy", "str", "fcfs", ("fcfs", "priority")),
    _f("--enable-chunked-prefill", "bool", None),
    _f("--disable-chunked-mm-input", "bool", False),
    _f("--scheduler-cls", "str"),
    _f("--disable-hybrid-kv-cache-manager", "bool", False),
    _f("--async-scheduling", "bool", False),
    # Speculative decoding, KV transfer, compilation, misc
    _f("--speculative-config", "str"),
    _f("--kv-transfer-config", "str"),
    _f("--kv-events-config", "str"),
    _f("--compilation-config -O", "str"),
    _f("--additional-config", "str"),
    _f("--disable-log-stats", "bool", False),
    _f("--enable-log-requests", "bool", False),
    _f("--disable-log-requests", "bool", False),
    _f("--mm-encoder-tp-mode", "str", "weights", ("weights", "data")),
    _f("--async-scheduling-mode", "str"),
    # Flags of slightly older vLLM releases (0.8-0.10) still found in deployments.
    _f("--enable-reasoning", "true", False),
    _f("--preemption-mode", "str"),
    _f("--max-seq-len-to-capture", "int", 8192),
    _f("--disable-async-output-proc", "true", False),
    _f("--tokenizer-pool-size", "int", 0),
    _f("--lora-extra-vocab-size", "int", 256),
    _f("--override-pooler-config", "str"),
)

SGLANG_FLAGS: tuple[Flag, ...] = (
    _f("--model-path --model", "str", None, required=True),
    _f("--tokenizer-path", "str"),
    _f("--tokenizer-mode", "str", "auto", ("auto", "slow")),
    _f("--tokenizer-worker-num", "int", 1),
    _f("--skip-tokenizer-init", "true", False),
    _f("--load-format", "str", "auto"),
    _f("--model-loader-extra-config", "str", "{}"),
    _f("--trust-remote-code", "true", False),
    _f("--context-length", "int"),
    _f("--is-embedding", "true", False),
    _f("--enable-multimodal", "true", False),
    _f("--revision", "str"),
    _f("--model-impl", "str", "auto"),
    _f("--host", "str", "127.0.0.1"),
    _f("--port", "int", 30000),
    _f("--skip-server-warmup", "true", False),
    _f("--warmups", "str"),
    _f("--nccl-port", "int"),
    _f("--dtype", "str", "auto", ("auto", "half", "float16", "bfloat16", "float", "float32")),
    _f("--quantization", "str"),
    _f("--quantization-param-path", "str"),
    _f("--kv-cache-dtype", "str", "auto"),
    _f("--mem-fraction-static", "float"),
    _f("--max-running-requests", "int"),
    _f("--max-queued-requests", "int"),
    _f("--max-total-tokens", "int"),
    _f("--chunked-prefill-size", "int"),
    _f("--max-prefill-tokens", "int", 16384),
    _f(
        "--schedule-policy",
        "str",
        "fcfs",
        ("lpm", "random", "fcfs", "dfs-weight", "lof", "priority"),
    ),
    _f("--schedule-conservativeness", "float", 1.0),
    _f("--page-size", "int", 1),
    _f("--device", "str"),
    _f("--tensor-parallel-size --tp-size", "int", 1),
    _f("--pipeline-parallel-size --pp-size", "int", 1),
    _f("--data-parallel-size --dp-size", "int", 1),
    _f("--expert-parallel-size --ep-size --ep", "int", 1),
    _f("--max-micro-batch-size", "int"),
    _f("--stream-interval", "int", 1),
    _f("--stream-output", "true", False),
    _f("--random-seed", "int"),
    _f("--constrained-json-whitespace-pattern", "str"),
    _f("--watchdog-timeout", "float", 300.0),
    _f("--dist-timeout", "int"),
    _f("--download-dir", "str"),
    _f("--base-gpu-id", "int", 0),
    _f("--gpu-id-step", "int", 1),
    _f("--sleep-on-idle", "true", False),
    _f("--log-level", "str", "info"),
    _f("--log-level-http", "str"),
    _f("--log-requests", "true", False),
    _f("--log-requests-level", "int", 0),
    _f("--crash-dump-folder", "str"),
    _f("--show-time-cost", "true", False),
    _f("--enable-metrics", "true", False),
    _f("--enable-metrics-for-all-schedulers", "true", False),
    _f("--bucket-time-to-first-token", "list"),
    _f("--bucket-inter-token-latency", "list"),
    _f("--bucket-e2e-request-latency", "list"),
    _f("--collect-tokens-histogram", "true", False),
    _f("--decode-log-interval", "int", 40),
    _f("--enable-request-time-stats-logging", "true", False),
    _f("--kv-events-config", "str"),
    _f("--api-key", "str"),
    _f("--served-model-name", "str"),
    _f("--chat-template", "str"),
    _f("--completion-template", "str"),
    _f("--file-storage-path", "str", "sglang_storage"),
    _f("--enable-cache-report", "true", False),
    _f("--reasoning-parser", "str"),
    _f("--tool-call-parser", "str"),
    _f("--dist-init-addr --nccl-init-addr", "str"),
    _f("--nnodes", "int", 1),
    _f("--node-rank", "int", 0),
    _f("--json-model-override-args", "str", "{}"),
    _f("--preferred-sampling-params", "str"),
    _f("--enable-lora", "true", False),
    _f("--max-lora-rank", "int"),
    _f("--lora-target-modules", "list"),
    _f("--lora-paths", "list"),
    _f("--max-loras-per-batch", "int", 8),
    _f("--lora-backend", "str", "triton"),
    _f("--attention-backend", "str"),
    _f("--prefill-attention-backend", "str"),
    _f("--decode-attention-backend", "str"),
    _f("--sampling-backend", "str"),
    _f("--grammar-backend", "str"),
    _f("--mm-attention-backend", "str"),
    _f("--speculative-algorithm", "str"),
    _f("--speculative-draft-model-path", "str"),
    _f("--speculative-num-steps", "int"),
    _f("--speculative-eagle-topk", "int"),
    _f("--speculative-num-draft-tokens", "int"),
    _f("--enable-dp-attention", "true", False),
    _f("--enable-dp-lm-head", "true", False),
    _f("--moe-a2a-backend", "str"),
    _f("--enable-eplb", "true", False),
    _f("--disaggregation-mode", "str", "null", ("null", "prefill", "decode")),
    _f("--disaggregation-transfer-backend", "str", "mooncake"),
    _f("--disaggregation-bootstrap-port", "int", 8998),
    _f("--enable-hierarchical-cache", "true", False),
    _f("--hicache-ratio", "float", 2.0),
    _f("--disable-radix-cache", "true", False),
    _f("--cuda-graph-max-bs", "int"),
    _f("--cuda-graph-bs", "list"),
    _f("--disable-cuda-graph", "true", False),
    _f("--disable-cuda-graph-padding", "true", False),
    _f("--enable-torch-compile", "true", False),
    _f("--torch-compile-max-bs", "int", 32),
    _f("--disable-overlap-schedule", "true", False),
    _f("--enable-mixed-chunk", "true", False),
    _f("--enable-p2p-check", "true", False),
    _f("--disable-custom-all-reduce", "true", False),
    _f("--disable-outlines-disk-cache", "true", False),
    _f("--enable-nan-detection", "true", False),
    _f("--triton-attention-reduce-in-fp32", "true", False),
    _f("--allow-auto-truncate", "true", False),
    _f("--enable-memory-saver", "true", False),
    _f("--enable-custom-logit-processor", "true", False),
    _f("--cpu-offload-gb", "int", 0),
    _f("--config", "str"),
    _f("--enable-deterministic-inference", "true", False),
    _f("--enable-ep-moe", "true", False),
    _f("--enable-two-batch-overlap", "true", False),
    _f("--hicache-size", "int", 0),
    _f("--kv-cache-memory", "int"),
    _f("--moe-runner-backend", "str", "auto"),
)

LLAMA_SERVER_FLAGS: tuple[Flag, ...] = (
    _f("--version", "true", False),
    _f("-t --threads", "int", -1),
    _f("-tb --threads-batch", "int", -1),
    _f("-c --ctx-size", "int", 4096),
    _f("-n --predict --n-predict", "int", -1),
    _f("-b --batch-size", "int", 2048),
    _f("-ub --ubatch-size", "int", 512),
    _f("--keep", "int", 0),
    _f("--swa-full", "true", False),
    _f("-fa --flash-attn", "opt", "auto"),
    _f("--no-perf", "true", False),
    _f("-e --escape", "true", False),
    _f("--no-escape", "true", False),
    _f("--rope-scaling", "str"),
    _f("--rope-scale", "float"),
    _f("--rope-freq-base", "float"),
    _f("--rope-freq-scale", "float"),
    _f("-nkvo --no-kv-offload", "true", False),
    _f("-ctk --cache-type-k", "str", "f16"),
    _f("-ctv --cache-type-v", "str", "f16"),
    _f("-dt --defrag-thold", "float"),
    _f("-np --parallel", "int", -1),
    _f("--mlock", "true", False),
    _f("--mmap", "true", False),
    _f("--no-mmap", "true", False),
    _f("--numa", "str"),
    _f("-dev --device", "str"),
    _f("--list-devices", "true", False),
    _f("-ngl --gpu-layers --n-gpu-layers", "str", "auto"),
    _f("-sm --split-mode", "str", "layer", ("none", "layer", "row")),
    _f("-ts --tensor-split", "str"),
    _f("-mg --main-gpu", "int", 0),
    _f("--check-tensors", "true", False),
    _f("--override-kv", "append"),
    _f("--lora", "append"),
    _f("--lora-scaled", "append"),
    _f("--lora-init-without-apply", "true", False),
    _f("-m --model", "str"),
    _f("-mu --model-url", "str"),
    _f("-hf -hfr --hf-repo", "str"),
    _f("-hff --hf-file", "str"),
    _f("-hft --hf-token", "str"),
    _f("--log-disable", "true", False),
    _f("--log-file", "str"),
    _f("--log-colors", "opt", "auto"),
    _f("-v --verbose --log-verbose", "true", False),
    _f("-lv --verbosity --log-verbosity", "int"),
    _f("--log-prefix", "true", False),
    _f("--log-timestamps", "true", False),
    _f("--samplers", "str"),
    _f("-s --seed", "int", -1),
    _f("--temp", "float", 0.8),
    _f("--top-k", "int", 40),
    _f("--top-p", "float", 0.95),
    _f("--min-p", "float", 0.05),
    _f("--repeat-penalty", "float", 1.0),
    _f("--embedding --embeddings", "true", False),
    _f("--reranking --rerank", "true", False),
    _f("--pooling", "str"),
    _f("-cb --cont-batching", "true", False),
    _f("-nocb --no-cont-batching", "true", False),
    _f("--mmproj", "str"),
    _f("--no-mmproj", "true", False),
    _f("-a --alias", "str"),
    _f("--host", "str", "127.0.0.1"),
    _f("--port", "int", 8080),
    _f("--path", "str"),
    _f("--api-prefix", "str", ""),
    _f("--no-webui", "true", False),
    _f("--api-key", "str"),
    _f("--api-key-file", "str"),
    _f("--ssl-key-file", "str"),
    _f("--ssl-cert-file", "str"),
    _f("--chat-template-kwargs", "str"),
    _f("-to --timeout", "int", 600),
    _f("--threads-http", "int", -1),
    _f("--cache-reuse", "int", 0),
    _f("--metrics", "true", False),
    _f("--slots", "true", False),
    _f("--no-slots", "true", False),
    _f("--props", "true", False),
    _f("--slot-save-path", "str"),
    _f("--jinja", "true", False),
    _f("--no-jinja", "true", False),
    _f("--reasoning-format", "str", "auto"),
    _f("--reasoning-budget", "int", -1),
    _f("--chat-template", "str"),
    _f("--chat-template-file", "str"),
    _f("-sps --slot-prompt-similarity", "float", 0.5),
    _f("--no-warmup", "true", False),
    _f("--spm-infill", "true", False),
    _f("--context-shift", "true", False),
    _f("--no-context-shift", "true", False),
    _f("-kvu --kv-unified", "true", False),
    _f("-cram --cache-ram", "int"),
    _f("-md --model-draft", "str"),
    _f("-td --threads-draft", "int"),
    _f("-ngld --gpu-layers-draft --n-gpu-layers-draft", "str"),
    _f("--draft-max --draft --draft-n", "int", 16),
    _f("--draft-min --draft-n-min", "int", 0),
    _f("--no-prefill-assistant", "true", False),
    _f("--ctx-checkpoints --swa-checkpoints", "int", 8),
    _f("-gan --grp-attn-n", "int", 1),
    _f("-gaw --grp-attn-w", "int", 512),
)

FLAG_TABLES: dict[EngineKind, tuple[Flag, ...]] = {
    "vllm": VLLM_FLAGS,
    "sglang": SGLANG_FLAGS,
    "llama-server": LLAMA_SERVER_FLAGS,
}

PROGS: dict[EngineKind, str] = {
    "vllm": "vllm serve",
    "sglang": "python -m sglang.launch_server",
    "llama-server": "llama-server",
}


def _option_strings(flag: Flag) -> list[str]:
    names = list(flag.names)
    if flag.kind == "bool":
        names += ["--no-" + n[2:] for n in flag.names if n.startswith("--")]
    return names


def known_flags(kind: EngineKind) -> frozenset[str]:
    """Every option string the simulator accepts for ``kind`` (``--x`` and ``--no-x`` forms)."""
    if kind not in FLAG_TABLES:
        raise ValueError(f"unknown engine kind {kind!r}; expected one of {', '.join(ENGINE_KINDS)}")
    return frozenset(name for flag in FLAG_TABLES[kind] for name in _option_strings(flag))


class LlamaArgumentParser(argparse.ArgumentParser):
    """llama.cpp parses its own flags: errors read ``error: ...`` and exit 1, not 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"error: {message}\n")
        sys.exit(1)


def build_parser(kind: EngineKind) -> argparse.ArgumentParser:
    parser_cls = LlamaArgumentParser if kind == "llama-server" else argparse.ArgumentParser
    parser = parser_cls(prog=PROGS[kind], allow_abbrev=False)
    if kind == "vllm":
        parser.add_argument("model_tag", nargs="?", default=None)
    for flag in FLAG_TABLES[kind]:
        kw: dict[str, object] = {"dest": flag.dest, "default": flag.default}
        if flag.kind == "int":
            kw["type"] = int
        elif flag.kind == "float":
            kw["type"] = float
        elif flag.kind == "hint":
            kw["type"] = human_readable_int
        elif flag.kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        elif flag.kind == "true":
            kw["action"] = "store_true"
        elif flag.kind == "list":
            kw["nargs"] = "+"
        elif flag.kind == "append":
            kw["action"] = "append"
        elif flag.kind == "opt":
            kw["nargs"] = "?"
            kw["const"] = "on"
        if flag.choices is not None:
            # --block-size is an int with a fixed set of values.
            kw["choices"] = (
                [int(c) for c in flag.choices] if flag.kind == "int" else list(flag.choices)
            )
        if flag.required:
            kw["required"] = True
        parser.add_argument(*flag.names, **kw)  # type: ignore[arg-type]
    return parser


def _normalize_vllm(argv: Sequence[str]) -> list[str]:
    # vLLM's FlexibleArgumentParser accepts --tensor_parallel_size as well as
    # --tensor-parallel-size.
    out: list[str] = []
    for arg in argv:
        if arg.startswith("--") and not arg.startswith("---"):
            key, sep, value = arg.partition("=")
            out.append(key.replace("_", "-") + sep + value)
        else:
            out.append(arg)
    return out


def parse_engine_args(kind: EngineKind, argv: Sequence[str]) -> argparse.Namespace:
    """Parse an engine's own command line; exits like the real engine on bad input."""
    parser = build_parser(kind)
    if kind == "vllm":
        return parser.parse_args(_normalize_vllm(argv))
    if kind == "llama-server":
        ns, extra = parser.parse_known_args(list(argv))
        if extra:
            parser.error(f"invalid argument: {extra[0]}")
        return ns
    return parser.parse_args(list(argv))
