"""Engine statistics and their Prometheus text, under each engine's real metric names."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from llmgw_sim.flags import EngineKind

# vLLM's own bucket bounds, so dashboards and quantile queries read the same.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
    5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip

ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def observe_many(self, value: float, times: int) -> None:
        self.counts[bisect_left(self.bounds, value)] += times
        self.total += value * times
        self.n += times

    def render(self, name: str, labels: str, out: list[str]) -> None:
        cumulative = 0
        sep = "," if labels else ""
        for bound, count in zip(self.bounds, self.counts, strict=False):
            cumulative += count
            out.append(f'{name}_bucket{{{labels}{sep}le="{bound}"}} {float(cumulative)}')
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {float(self.n)}')
        out.append(f"{name}_count{{{labels}}} {float(self.n)}")
        out.append(f"{name}_sum{{{labels}}} {self.total}")


@dataclass
class Stats:
    """What a running engine counts.  Gauges are read through callbacks at scrape time."""

    running: Callable[[], int] = lambda: 0
    waiting: Callable[[], int] = lambda: 0
    kv_usage: Callable[[], float] = lambda: 0.0
    kv_tokens: Callable[[], int] = lambda: 0
    prefix_queries: Callable[[], int] = lambda: 0
    prefix_hits: Callable[[], int] = lambda: 0
    preemptions: Callable[[], int] = lambda: 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_ok: dict[str, int] = field(
        default_factory=lambda: {"stop": 0, "length": 0, "abort": 0}
    )
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    prefill_time: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    decode_time: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    inference_time: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    # Token-count histograms use vLLM's 1-2-5 buckets up to max_model_len.
    prompt_len: Histogram = field(default_factory=lambda: Histogram(buckets_1_2_5(32768)))
    gen_len: Histogram = field(default_factory=lambda: Histogram(buckets_1_2_5(32768)))
    max_tokens_param: Histogram = field(default_factory=lambda: Histogram(buckets_1_2_5(32768)))
    decode_steps: int = 0
    # Tokens per engine step (vLLM's vllm:iteration_tokens_total), step scheduler only.
    iteration_tokens: Histogram = field(default_factory=lambda: Histogram(ITERATION_BUCKETS))
    cache_info: dict[str, str] = field(default_factory=dict)
    # (max_loras, running adapters, waiting adapters) when LoRA is enabled.
    lora_info: Callable[[], tuple[int, list[str], list[str]]] | None = None

    def size_token_histograms(self, max_model_len: int) -> None:
        bounds = buckets_1_2_5(max_model_len)
        self.prompt_len = Histogram(bounds)
        self.gen_len = Histogram(bounds)
        self.max_tokens_param = Histogram(bounds)


def buckets_1_2_5(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit``, as vLLM builds its token buckets."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            value = m * scale
            if value > limit:
                return tuple(out)
            out.append(float(value))
        scale *= 10


def _counter(out: list[str], name: str, help_: str, labels: str, value: float) -> None:
    out.append(f"# HELP {name} {help_}")
    out.append(f"# TYPE {name} counter")
    out.append(f"{name}{{{labels}}} {float(value)}")


def _gauge(out: list[str], name: str, help_: str, labels: str, value: float) -> None:
    out.append(f"# HELP {name} {help_}")
    out.append(f"# TYPE {name} gauge")
    out.append(f"{name}{{{labels}}} {float(value)}")


def _hist(out: list[str], name: str, help_: str, labels: str, h: Histogram) -> None:
    out.append(f"# HELP {name} {help_}")
    out.append(f"# TYPE {name} histogram")
    h.render(name, labels, out)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_vllm(stats: Stats, model_name: str) -> str:
    lbl = f'engine="0",model_name="{_escape(model_name)}"'
    out: list[str] = []
    gauges = (
        ("vllm:num_requests_running", "Number of requests in model execution batches.",
         stats.running()),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
         stats.waiting()),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
         stats.kv_usage()),
    )  # fmt: skip
    for name, help_, value in gauges:
        _gauge(out, name, help_, lbl, value)
    if stats.cache_info:
        info = ",".join(f'{k}="{_escape(v)}"' for k, v in stats.cache_info.items())
        _gauge(out, "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", info, 1)
    if stats.lora_info is not None:
        max_lora, running, waiting = stats.lora_info()
        labels = (
            f'max_lora="{max_lora}",running_lora_adapters="{",".join(running)}",'
            f'waiting_lora_adapters="{",".join(waiting)}"'
        )
        # vLLM reports the scrape time as this info gauge's value.
        _gauge(
            out, "vllm:lora_requests_info", "Running stats on lora requests.", labels, time.time()
        )
    counters = (
        ("vllm:prefix_cache_queries_total",
         "Prefix cache queries, in terms of number of queried tokens.", stats.prefix_queries()),
        ("vllm:prefix_cache_hits_total",
         "Prefix cache hits, in terms of number of cached tokens.", stats.prefix_hits()),
        ("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.",
         stats.preemptions()),
        ("vllm:prompt_tokens_cached_total",
         "Number of cached prompt tokens (local prefix cache hits).", stats.prefix_hits()),
        ("vllm:prompt_tokens_total", "Number of prefill tokens processed.", stats.prompt_tokens),
        ("vllm:generation_tokens_total", "Number of generation tokens processed.",
         stats.generation_tokens),
    )  # fmt: skip
    for name, help_, value in counters:
        _counter(out, name, help_, lbl, value)
    out.append("# HELP vllm:request_success_total Count of successfully processed requests.")
    out.append("# TYPE vllm:request_success_total counter")
    for reason, count in stats.requests_ok.items():
        out.append(f'vllm:request_success_total{{{lbl},finished_reason="{reason}"}} {float(count)}')
    histograms = (
        ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
         stats.ttft),
        ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
         stats.itl),
        ("vllm:time_per_output_token_seconds",
         "Histogram of time per output token in seconds (deprecated name of inter-token "
         "latency).", stats.itl),
        ("vllm:request_time_per_output_token_seconds",
         "Histogram of time_per_output_token_seconds per request.", stats.tpot),
        ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
         stats.e2e),
        ("vllm:request_queue_time_seconds",
         "Histogram of time spent in WAITING phase for request.", stats.queue_time),
        ("vllm:request_inference_time_seconds",
         "Histogram of time spent in RUNNING phase for request.", stats.inference_time),
        ("vllm:request_prefill_time_seconds",
         "Histogram of time spent in PREFILL phase for request.", stats.prefill_time),
        ("vllm:request_decode_time_seconds",
         "Histogram of time spent in DECODE phase for request.", stats.decode_time),
        ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", stats.prompt_len),
        ("vllm:request_generation_tokens", "Number of generation tokens processed.",
         stats.gen_len),
        ("vllm:request_max_num_generation_tokens",
         "Histogram of maximum number of requested generation tokens.", stats.gen_len),
        ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
         stats.max_tokens_param),
        ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
         stats.iteration_tokens),
    )  # fmt: skip
    for name, help_, hist in histograms:
        _hist(out, name, help_, lbl, hist)
    return "\n".join(out) + "\n"


def render_sglang(stats: Stats, model_name: str) -> str:
    lbl = f'model_name="{_escape(model_name)}"'
    out: list[str] = []
    queries = stats.prefix_queries()
    hit_rate = stats.prefix_hits() / queries if queries else 0.0
    _gauge(out, "sglang:num_running_reqs", "The number of running requests.", lbl, stats.running())
    _gauge(
        out,
        "sglang:num_queue_reqs",
        "The number of requests in the waiting queue.",
        lbl,
        stats.waiting(),
    )
    _gauge(out, "sglang:num_used_tokens", "The number of used tokens.", lbl, stats.kv_tokens())
    _gauge(out, "sglang:token_usage", "The token usage.", lbl, stats.kv_usage())
    _gauge(out, "sglang:cache_hit_rate", "The prefix cache hit rate.", lbl, hit_rate)
    _gauge(out, "sglang:gen_throughput", "The generation throughput (token/s).", lbl, 0.0)
    _counter(
        out,
        "sglang:prompt_tokens_total",
        "Number of prefill tokens processed.",
        lbl,
        stats.prompt_tokens,
    )
    _counter(
        out,
        "sglang:generation_tokens_total",
        "Number of generation tokens processed.",
        lbl,
        stats.generation_tokens,
    )
    _counter(
        out,
        "sglang:cached_tokens_total",
        "Number of cached prompt tokens.",
        lbl,
        stats.prefix_hits(),
    )
    _counter(
        out,
        "sglang:num_requests_total",
        "Number of requests processed.",
        lbl,
        sum(stats.requests_ok.values()),
    )
    _hist(
        out,
        "sglang:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        lbl,
        stats.ttft,
    )
    _hist(
        out,
        "sglang:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        lbl,
        stats.itl,
    )
    _hist(
        out,
        "sglang:e2e_request_latency_seconds",
        "Histogram of End-to-end request latency in seconds",
        lbl,
        stats.e2e,
    )
    return "\n".join(out) + "\n"


def render_llamacpp(stats: Stats) -> str:
    # llama.cpp's metrics carry no labels.
    out: list[str] = []
    prompt_tps = stats.prompt_tokens / stats.prompt_seconds if stats.prompt_seconds else 0.0
    gen_tps = stats.generation_tokens / stats.decode_seconds if stats.decode_seconds else 0.0
    busy = stats.running()
    _counter(
        out,
        "llamacpp:prompt_tokens_total",
        "Number of prompt tokens processed.",
        "",
        stats.prompt_tokens,
    )
    _counter(out, "llamacpp:prompt_seconds_total", "Prompt process time", "", stats.prompt_seconds)
    _counter(
        out,
        "llamacpp:tokens_predicted_total",
        "Number of generation tokens processed.",
        "",
        stats.generation_tokens,
    )
    _counter(
        out,
        "llamacpp:tokens_predicted_seconds_total",
        "Predict process time",
        "",
        stats.decode_seconds,
    )
    _counter(
        out,
        "llamacpp:n_decode_total",
        "Total number of llama_decode() calls",
        "",
        stats.decode_steps,
    )
    _gauge(
        out,
        "llamacpp:n_busy_slots_per_decode",
        "Average number of busy slots per llama_decode() call",
        "",
        float(busy),
    )
    _gauge(
        out,
        "llamacpp:prompt_tokens_seconds",
        "Average prompt throughput in tokens/s.",
        "",
        prompt_tps,
    )
    _gauge(
        out,
        "llamacpp:predicted_tokens_seconds",
        "Average generation throughput in tokens/s.",
        "",
        gen_tps,
    )
    _gauge(
        out,
        "llamacpp:kv_cache_usage_ratio",
        "KV-cache usage. 1 means 100 percent usage.",
        "",
        stats.kv_usage(),
    )
    _gauge(out, "llamacpp:kv_cache_tokens", "KV-cache tokens.", "", stats.kv_tokens())
    _gauge(out, "llamacpp:requests_processing", "Number of requests processing.", "", busy)
    _gauge(out, "llamacpp:requests_deferred", "Number of requests deferred.", "", stats.waiting())
    # Prometheus wants "name value" without braces when there are no labels.
    return "\n".join(line.replace("{}", "") for line in out) + "\n"


def render(kind: EngineKind, stats: Stats, model_name: str) -> str:
    if kind == "vllm":
        return render_vllm(stats, model_name)
    if kind == "sglang":
        return render_sglang(stats, model_name)
    return render_llamacpp(stats)


def parse_prometheus(text: str) -> dict[str, float]:
    """Samples of a Prometheus text page as ``{'name{labels}': value}`` (for tests and tools)."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        samples[key] = float(value)
    return samples


def sample(samples: dict[str, float], name: str) -> float | None:
    """The first sample whose series is ``name`` (any labels)."""
    for key, value in samples.items():
        if key == name or key.startswith(name + "{"):
            return value
    return None


__all__: Sequence[str] = ["Histogram", "Stats", "parse_prometheus", "render", "sample"]
