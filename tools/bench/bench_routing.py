"""Routing quality: TTFT, throughput and prefix-cache hit rate of balancers on one fleet.

    python tools/bench/bench_routing.py                          # every workload and target
    python tools/bench/bench_routing.py --workloads a --targets round_robin cache_aware
    python tools/bench/bench_routing.py --seconds 20 --repeat 2 --json

A fleet of simulated vLLM engines (``llmgw-sim vllm serve`` with the step scheduler:
a token budget per step, continuous batching, a finite block KV cache with prefix
caching and LRU eviction) is started as processes, fresh for every run so no run
inherits another's cache. Each target routes the same open-loop Poisson arrivals of
streaming chat completions (16 output tokens) for ``--seconds``:

- (a) ``tenants``: 32 tenants, each with its own ~2,000-token system prompt, and a short
  unique user turn; arrivals at ``--load`` (default 75 %) of the fleet's capacity
  without cache hits;
- (b) ``unique``: every prompt its own ~2,000 tokens (nothing to share), same rate;
- (c) ``hot``: one system prompt for every request, same rate;
- (d) ``tenants x4``: (a) through 4 llmgw routers at once, requests spread round robin
  over them (cache_aware only: it is the one meant to agree across routers);
- (e) ``tenants mixed``: (a), each request written by one of two JSON clients;
- (f) ``zipf``: (a) with Zipf-skewed tenant popularity (exponent ``--zipf``, default 1.0:
  tenant k's share is proportional to 1/k);
- (g) ``multiturn``: conversations (``--conversations`` at once, each a tenant's system
  prompt) whose prompts grow by one user and one assistant turn a request, up to
  ``--turns`` turns, then a new conversation of a random tenant takes its place.

Cache sizes (``--caches``): ``roomy``, ``--kv-blocks`` per engine (default 1,536 blocks
of 16 tokens: about 11 of the 32 tenants' prefixes), and ``tight``, a quarter of all
tenants' prefixes per engine plus 88 blocks for the requests in flight (1,088 at the
defaults: about 8.7 prefixes). llmgw's static endpoints are told each engine's cache
(``cache_tokens``) and the workload's prompt bytes per token (``bytes_per_token``), as an
operator would configure them; behind the control plane the engines report their caches.

Targets: llmgw-router ``round_robin``, ``least_outstanding`` and ``cache_aware`` (one
process, ``workers: 1``), and the Rust routers from PyPI on the same fleet:
``sglang-router`` (``--policy cache_aware``) and ``vllm-router`` (``--policy
cache_aware``), looked for in ``.cache/bench-routing`` (``uv venv .cache/bench-routing
&& uv pip install -p .cache/bench-routing/bin/python sglang-router vllm-router``); a
missing one is skipped. Targets alternate within each workload (and rotate between
repeats), so a busy neighbour on this shared machine hits all of them alike.

``--fleet control`` (the default) runs the fleet the way llmgw does: a real
``llmgw-control serve`` and one ``llmgw-agent run`` (a node with one simulated GPU per
engine) that launches the simulated engines through its vLLM adapter and reads their
/metrics into load reports; llmgw's routers take their endpoints and the engines' load
figures from the control plane (``Watch`` and ``WatchLoad``) and are measured once every
engine's figures have reached them; the Rust routers get the same engines' URLs.
``--fleet static`` starts the engines directly and gives llmgw's routers static
endpoints (their own counts only, no engine figures).

``--engine llamacpp`` serves real ``llama-server`` replicas (CPU, the small GGUF model
the real-engine suite uses; ``--llama-args``, default two slots with their own prompt
caches and no host-memory cache between them) through the control fleet; give
``--rate`` and a workload that size fits (``--tenants``, ``--system-words``, ...).

Reported per run: TTFT p50/p90/p99 (client side: request sent to first token), requests
per second completed, the prefix-cache hit rate (the engines' own
``vllm:prefix_cache_hits_total`` over ``..._queries_total``; each engine's too in
``--json``), max/mean requests per engine, the router's CPU per request (its process and
threads, /proc) and the machine's load average at the run's start; llama.cpp: its
``llamacpp:prompt_tokens_total`` per request (per engine requests estimated from
``llamacpp:tokens_predicted_total``) instead of a hit rate. The first
``--warmup`` fraction of arrivals (cold caches) is sent but not counted.

The engines run ``--time-scale`` (default 2) times slower than the simulator's H100-like
defaults (prefill 20,000 tokens/s, 8 ms steps), so the whole fleet's request rate stays
low enough that this 2-core shared machine's load generator and routers are not the
bottleneck; the load generator's own CPU is printed to show it.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from benchlib import cpu_seconds, serving, use_uvloop
from llmgw_sim.metrics import parse_prometheus
from llmgw_testkit import free_port, http_get, wait_for
from llmgw_testkit.cluster import Cluster, vllm_profile
from llmgw_testkit.tokenizer import write_word_tokenizer

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PEERS = ROOT / ".cache" / "bench-routing" / "bin"
MODEL = "m"
OUT_TOKENS = 16
SYSTEM_TOKENS = 2000
USER_TOKENS = 30
TENANTS = 32


@dataclass(frozen=True)
class Shape:
    """The requests' sizes: tenants, words per system prompt and user turn, output tokens
    (the simulator counts a word as one token; a real tokenizer makes more of them)."""

    tenants: int = TENANTS
    system: int = SYSTEM_TOKENS
    user: int = USER_TOKENS
    out: int = OUT_TOKENS

    @property
    def prompt_tokens(self) -> int:
        return self.system + self.user + 8  # + the chat template's tokens


LLMGW = ("round_robin", "least_outstanding", "cache_aware", "cache_aware+tokens")
# cache_aware with precise matching: cache_aware.tokenizers names the engines' tokenizer
# (--precise: the simulated engines tokenize with a real word-level tokenizer and publish
# KV events with token ids; the router tokenizes prompts with the same files).
PRECISE = "cache_aware+tokens"
PEER_TARGETS = ("sglang-router", "vllm-router")
WORKLOADS = {
    "a": "tenants",
    "b": "unique",
    "c": "hot",
    "d": "tenants x4",
    "e": "tenants mixed",
    "f": "zipf",
    "g": "multiturn",
}
TENANT_WORKLOADS = ("tenants", "tenants x4", "tenants mixed", "zipf", "multiturn")
# --zipf, --conversations, --turns: the zipf and multiturn workloads' knobs.
SKEW = {"zipf": 1.0, "conversations": 64, "turns": 8}
# The static endpoints' cache_tokens (set per run from the fleet's KV blocks).
CACHE_TOKENS: list[int] = []
# The admin ports of the llmgw routers of the current run (for their picks' reasons).
ADMINS: list[int] = []
# Words of the user turns when a real tokenizer reads them (--precise): in its vocabulary.
USER_VOCABULARY = 5000
# --cache-aware-epsilon / --cache-aware-slack: the bounded-load settings given to llmgw's
# cache_aware (the router's defaults for those not set).
CACHE_AWARE: dict[str, float] = {}
# --precise: the tokenizer folder the engines and cache_aware+tokens load.
TOKENIZER: list[str] = []


@dataclass(frozen=True)
class Fleet:
    engines: int
    time_scale: float
    kv_blocks: int
    block_size: int = 16
    # --precise: the engines' tokenizer folder (and KV events on a port of the agent's).
    tokenizer: str = ""

    def precise_args(self) -> list[str]:
        if not self.tokenizer:
            return []
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0"}
        return ["--block-size", str(self.block_size), "--tokenizer", self.tokenizer,
                "--kv-events-config", json.dumps(events)]  # fmt: skip

    @property
    def prefill_rate(self) -> float:
        return 20_000.0 / self.time_scale

    @property
    def step_time(self) -> float:
        return 0.008 * self.time_scale

    @property
    def decode_seq_time(self) -> float:
        return 0.0001 * self.time_scale

    def capacity(self, shape: Shape) -> float:
        """Requests/s the fleet serves when nothing is cached: each request's prefill,
        its share of the steps' fixed cost and its decodes, engine by engine."""
        per_request = (
            shape.prompt_tokens / self.prefill_rate
            + self.step_time
            + shape.out * self.decode_seq_time
        )
        return self.engines / per_request

    def engine_args(self, seed: int) -> list[str]:
        return [
            "--served-model-name", MODEL, "--max-model-len", "4096",
            "--num-gpu-blocks-override", str(self.kv_blocks),
            "--sim-scheduler", "step", "--sim-seed", str(seed),
            "--sim-prefill-rate", f"{self.prefill_rate:g}",
            "--sim-step-time", f"{self.step_time:g}",
            "--sim-decode-seq-time", f"{self.decode_seq_time:g}",
        ]  # fmt: skip

    def profile(self) -> dict[str, object]:
        """The same engines as a control-plane profile: the engine's own flags as
        ``engine_args``, the simulator's knobs as its ``LLMGW_SIM_*`` environment."""
        return vllm_profile(
            replicas=self.engines,
            args=[
                *("--max-model-len", "4096", "--num-gpu-blocks-override", str(self.kv_blocks)),
                *self.precise_args(),
            ],
            env={
                "LLMGW_SIM_SCHEDULER": "step",
                "LLMGW_SIM_PREFILL_RATE": f"{self.prefill_rate:g}",
                "LLMGW_SIM_STEP_TIME": f"{self.step_time:g}",
                "LLMGW_SIM_DECODE_SEQ_TIME": f"{self.decode_seq_time:g}",
                "LLMGW_SIM_LOAD_TIME": "0.2",
                # The agent keys each engine; the peer routers cannot know the keys.
                "LLMGW_SIM_OPEN": "1",
            },
        )


# ----- workloads -----------------------------------------------------------------------


def _words(prefix: str, n: int) -> str:
    # One simulator token per word ("t3w17" with its leading space).
    return " ".join(f"{prefix}w{i}" for i in range(n))


def vocabulary(shape: Shape) -> list[str]:
    """Every word the tenant workloads send with --precise (the tokenizer's vocabulary)."""
    words = [f"t{t}w{i}" for t in range(shape.tenants) for i in range(shape.system)]
    return words + [f"q{k}" for k in range(USER_VOCABULARY)]


def request_bodies(
    workload: str, count: int, seed: int, shape: Shape = Shape(), *, precise: bool = False
) -> list[bytes]:
    """The requests' JSON. "tenants mixed": the tenants, each request serialised by one of
    two clients, which write the same conversation differently (key order and spacing:
    other bytes, the same prompt for the engine's tokenizer)."""
    rng = random.Random(seed)
    systems = [_words(f"t{t}", shape.system) for t in range(shape.tenants)]
    out: list[bytes] = []
    if workload == "multiturn":
        return _conversations(rng, systems, count, shape, precise)
    popularity = [1.0 / (k + 1) ** SKEW["zipf"] for k in range(shape.tenants)]
    for i in range(count):
        if workload == "zipf":
            (system,) = rng.choices(systems, weights=popularity)
        elif workload in TENANT_WORKLOADS:
            system = systems[rng.randrange(shape.tenants)]
        elif workload == "hot":
            system = systems[0]
        else:
            system = _words(f"u{seed}r{i}", shape.system)
        if precise:
            user = " ".join(f"q{rng.randrange(USER_VOCABULARY)}" for _ in range(shape.user))
        else:
            user = " ".join(f"q{i}x{rng.randrange(10**6)}" for _ in range(shape.user))
        if workload == "tenants mixed" and rng.random() < 0.5:
            # The other client: keys in another order, no spaces between them.
            other = {
                "stream": True,
                "max_tokens": shape.out,
                "messages": [
                    {"content": system, "role": "system"},
                    {"content": user, "role": "user"},
                ],
                "model": MODEL,
            }
            out.append(json.dumps(other, separators=(",", ":")).encode())
            continue
        body = {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": user},
            ],
            "max_tokens": shape.out,
            "stream": True,
        }
        out.append(json.dumps(body).encode())
    return out


def _turn(rng: random.Random, words: int, i: int, precise: bool) -> str:
    if precise:
        return " ".join(f"q{rng.randrange(USER_VOCABULARY)}" for _ in range(words))
    return " ".join(f"q{i}x{rng.randrange(10**6)}" for _ in range(words))


def _conversations(
    rng: random.Random, systems: Sequence[str], count: int, shape: Shape, precise: bool
) -> list[bytes]:
    """Multi-turn chats: each request continues one of the open conversations (its
    earlier turns, an assistant answer of ``shape.out`` words each, then a new user
    turn); one that reached SKEW["turns"] turns is replaced by a new one."""
    open_: list[list[dict[str, str]]] = []
    out: list[bytes] = []
    for i in range(count):
        if len(open_) < SKEW["conversations"]:
            open_.append([{"role": "system", "content": rng.choice(systems)}])
        at = rng.randrange(len(open_))
        messages = open_[at]
        if len(messages) > 1:
            messages.append({"role": "assistant", "content": _turn(rng, shape.out, i, precise)})
        messages.append({"role": "user", "content": _turn(rng, shape.user, i, precise)})
        body = {"model": MODEL, "messages": messages, "max_tokens": shape.out, "stream": True}
        out.append(json.dumps(body).encode())
        if len(messages) >= 2 * SKEW["turns"]:
            open_[at] = [{"role": "system", "content": rng.choice(systems)}]
    return out


def arrival_times(rate: float, seconds: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t = 0.0
    out: list[float] = []
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        out.append(t)


# ----- load ----------------------------------------------------------------------------


@dataclass
class Result:
    workload: str
    target: str
    rate: float
    cache: str = "roomy"
    fleet: str = "control"
    sent: int = 0
    ok: int = 0
    errors: int = 0
    ttft: list[float] = field(default_factory=list)
    duration: float = 0.0
    hit_rate: float = 0.0
    per_engine: list[int] = field(default_factory=list)
    per_engine_hit: list[float] = field(default_factory=list)  # each engine's own hit rate
    router_cpu: float = 0.0  # seconds, all router processes, over every request sent
    all_sent: int = 0  # warm-up included
    loadgen_cpu: float = 0.0
    watched: int = 0  # samples of every engine's running/waiting (after the warm-up)
    idle_while_queued: int = 0  # of them: an engine idle while another had requests waiting
    prompt_evaluated: float = math.nan  # llama.cpp: prompt tokens evaluated per request
    loadavg: str = ""  # /proc/loadavg's 1, 5 and 15 minute figures at the run's start
    control_cpu: float = 0.0  # seconds: control plane and agent, over the run (control fleet)
    # llmgw's routers: picks by reason (llmgw_router_picks_total), summed over them.
    reasons: dict[str, int] = field(default_factory=dict)

    def pct(self, q: float) -> float:
        if not self.ttft:
            return math.nan
        data = sorted(self.ttft)
        return data[min(len(data) - 1, int(q * len(data)))]

    @property
    def throughput(self) -> float:
        return self.ok / self.duration if self.duration else 0.0

    @property
    def max_mean(self) -> float:
        mean = statistics.fmean(self.per_engine) if self.per_engine else 0.0
        return max(self.per_engine) / mean if mean else math.nan

    @property
    def cpu_ms_per_request(self) -> float:
        return 1000 * self.router_cpu / self.all_sent if self.all_sent else math.nan

    def row(self) -> dict[str, object]:
        return {
            "workload": self.workload,
            "target": self.target,
            "cache": self.cache,
            "fleet": self.fleet,
            "rate": round(self.rate, 2),
            "sent": self.sent,
            "ok": self.ok,
            "errors": self.errors,
            "ttft_p50_ms": round(1000 * self.pct(0.5), 1),
            "ttft_p90_ms": round(1000 * self.pct(0.9), 1),
            "ttft_p99_ms": round(1000 * self.pct(0.99), 1),
            "throughput": round(self.throughput, 2),
            "hit_rate": round(self.hit_rate, 3),
            "max_mean": round(self.max_mean, 2),
            "per_engine": self.per_engine,
            "per_engine_hit": [round(h, 3) for h in self.per_engine_hit],
            "router_cpu_ms_per_req": round(self.cpu_ms_per_request, 2),
            "loadgen_cpu_share": round(self.loadgen_cpu / self.duration, 2)
            if self.duration
            else None,
            "control_agent_cpu_share": round(self.control_cpu / self.duration, 2)
            if self.duration
            else None,
            "loadavg": self.loadavg,
            "reasons": self.reasons,
            "idle_while_queued": f"{self.idle_while_queued}/{self.watched}",
            "prompt_tokens_evaluated_per_req": None
            if math.isnan(self.prompt_evaluated)
            else round(self.prompt_evaluated, 1),
        }


async def _one(
    session: aiohttp.ClientSession, url: str, body: bytes, at: float, start: float
) -> float | None:
    """Send at ``start + at``; the seconds to the first token, None on failure."""
    delay = start + at - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = time.monotonic()
    first: float | None = None
    try:
        async with session.post(
            url, data=body, headers={"Content-Type": "application/json"}
        ) as resp:
            if resp.status != 200:
                await resp.read()
                return None
            async for line in resp.content:
                # The first token's chunk (the role chunk before it carries none).
                if first is None and b'"delta":{"content":' in line:
                    first = time.monotonic() - sent
    except (TimeoutError, aiohttp.ClientError):
        return None
    return first


async def drive(
    urls: Sequence[str], bodies: Sequence[bytes], times: Sequence[float], warm: int
) -> tuple[list[float | None], float]:
    timeout = aiohttp.ClientTimeout(total=120)
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.monotonic() + 0.2
        tasks = [
            asyncio.create_task(
                _one(session, urls[i % len(urls)] + "/v1/chat/completions", b, t, start)
            )
            for i, (b, t) in enumerate(zip(bodies, times, strict=True))
        ]
        results = await asyncio.gather(*tasks)
        duration = time.monotonic() - (start + (times[warm] if warm < len(times) else 0))
    return list(results), duration


# ----- processes -----------------------------------------------------------------------


def _engine_samples(url: str) -> dict[str, float]:
    status, body = http_get(url + "/metrics", timeout=10)
    return parse_prometheus(body.decode()) if status == 200 else {}


def _sum(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


@contextlib.contextmanager
def fleet_up(fleet: Fleet, logs: Path) -> Iterator[list[str]]:
    with contextlib.ExitStack() as stack:
        urls: list[str] = []
        procs = []
        for i in range(fleet.engines):
            port = free_port()
            argv = [str(BIN / "llmgw-sim"), "vllm", "serve", "org/model", "--host",
                    "127.0.0.1", "--port", str(port), *fleet.engine_args(i)]  # fmt: skip
            url = f"http://127.0.0.1:{port}"
            procs.append((argv, url))
        for argv, url in procs:
            stack.enter_context(
                serving(
                    argv,
                    health=url + "/health",
                    what="llmgw-sim",
                    log_dir=logs,
                    name="engine",
                    env={"CUDA_VISIBLE_DEVICES": "0"},
                    timeout=60,
                )
            )
            urls.append(url)
        yield urls


@contextlib.contextmanager
def control_fleet_up(fleet: Fleet, workdir: Path) -> Iterator[tuple[Cluster, list[str]]]:
    """The fleet the way llmgw runs it: a real ``llmgw-control serve`` and one ``llmgw-agent
    run`` (a node of ``fleet.engines`` simulated GPUs) that launches the simulated vLLM
    engines through its vLLM adapter and reads their /metrics into load reports.
    Yields the cluster and the engines' URLs (from the control plane's status)."""
    with Cluster(workdir, insecure=True, timings={"load_interval": "250ms"}) as cluster:
        cluster.start_control([{"name": MODEL, "profiles": {"default": fleet.profile()}}])
        cluster.start_agent("node-0", gpus=fleet.engines)
        replicas = cluster.wait_replicas(MODEL, fleet.engines, timeout=120)
        urls = sorted(str(r["endpoint"]) for r in replicas)
        yield cluster, urls


@contextlib.contextmanager
def llamacpp_fleet_up(
    args: argparse.Namespace, workdir: Path
) -> Iterator[tuple[Cluster, list[str]]]:
    """``--engines`` real llama-server replicas of the small GGUF model on one CPU node,
    launched by ``llmgw-agent`` under ``llmgw-control`` (tests-real-engine's profile)."""
    from bench_real_engine import find_gguf, find_llama_server

    server, gguf = find_llama_server(args.llama_server), find_gguf(args.gguf)
    if server is None or gguf is None:
        raise SystemExit(
            "bench_routing --engine llamacpp: no llama-server or model here "
            "(run `nox -s real_engine` once, or pass --llama-server and --gguf)"
        )
    profile = {
        "engine": "llamacpp",
        "model_ref": str(gguf),
        "engine_args": args.llama_args.split(),
        "gpus_per_node": 0,
        "cpu_threads": args.cpu_threads,
        "served_model_names": [MODEL],
        "replicas": args.engines,
        "load_timeout": "300s",
    }
    with Cluster(workdir, insecure=True, timings={"load_interval": "250ms"}) as cluster:
        cluster.start_control([{"name": MODEL, "profiles": {"cpu": profile}}])
        cluster.start_agent(
            "cpu-0",
            simulate_gpus=None,
            engines={"llamacpp": {"command": [str(server)]}},
            stop_engines_on_exit=True,
        )
        replicas = cluster.wait_replicas(MODEL, args.engines, timeout=300)
        yield cluster, sorted(str(r["endpoint"]) for r in replicas)


def _router_endpoints(admin: int) -> list[dict[str, object]]:
    status, body = http_get(f"http://127.0.0.1:{admin}/v1/endpoints", timeout=5)
    return list(json.loads(body)["endpoints"]) if status == 200 else []


@contextlib.contextmanager
def router_up(
    target: str,
    engines: Sequence[str],
    logs: Path,
    copies: int = 1,
    cluster: Cluster | None = None,
) -> Iterator[tuple[list[str], list[int]]]:
    """``copies`` routers of ``target`` in front of ``engines``: (base URLs, pids).

    With ``cluster``, llmgw's routers take their endpoints and the engines' load reports
    from its control plane (``EndpointService.Watch`` and ``WatchLoad``) and are ready
    once every engine's figures have arrived; without, static endpoints."""
    with contextlib.ExitStack() as stack:
        urls: list[str] = []
        pids: list[int] = []
        for copy in range(copies):
            port = free_port()
            admin = free_port()
            if target in LLMGW:
                config = logs / f"router-{port}.yaml"
                source: dict[str, object]
                if cluster is not None:
                    source = {
                        "control": {
                            "address": f"127.0.0.1:{cluster.grpc_port}",
                            "router_id": f"bench-{copy}",
                            "tls": {"insecure": True},
                        }
                    }
                else:
                    source = {
                        "endpoints": [
                            {"id": f"e{i}", "url": u, "models": [MODEL]}
                            | ({"cache_tokens": CACHE_TOKENS[0]} if CACHE_TOKENS else {})
                            for i, u in enumerate(engines)
                        ]
                    }
                config.write_text(
                    json.dumps(
                        {
                            "listen": f"127.0.0.1:{port}",
                            "admin_listen": f"127.0.0.1:{admin}",
                            "balancer": "cache_aware" if target == PRECISE else target,
                            "workers": 1,
                            **(
                                {
                                    "cache_aware": {
                                        **CACHE_AWARE,
                                        **(
                                            {"tokenizers": {MODEL: TOKENIZER[0]}}
                                            if target == PRECISE
                                            else {}
                                        ),
                                    }
                                }
                                if target in ("cache_aware", PRECISE)
                                else {}
                            ),
                            **source,
                        }
                    )
                )
                argv = [str(BIN / "llmgw-router"), "serve", "--config", str(config),
                        "--log-level", "warning"]  # fmt: skip
                health = f"http://127.0.0.1:{admin}/readyz"
            elif target == "sglang-router":
                argv = [str(PEERS / "sglang-router"), "launch", "--host", "127.0.0.1",
                        "--port", str(port), "--worker-urls", *engines,
                        "--policy", "cache_aware", "--prometheus-port", str(free_port()),
                        "--log-level", "warn"]  # fmt: skip
                health = f"http://127.0.0.1:{port}/health"
            else:
                argv = [str(PEERS / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
                        "--worker-urls", *engines, "--policy", "cache_aware",
                        "--prometheus-port", str(free_port()), "--log-level", "warning"]  # fmt: skip
                health = f"http://127.0.0.1:{port}/health"
            proc = stack.enter_context(
                serving(argv, health=health, what=target, log_dir=logs, name=target, timeout=60)
            )
            if cluster is not None and target in LLMGW:

                def reporting(admin: int = admin) -> bool:
                    eps = _router_endpoints(admin)
                    return len(eps) == len(engines) and all(
                        e.get("load_source") == "engine" for e in eps
                    )

                wait_for(reporting, timeout=60, what=f"{target}: every engine's load report")
            urls.append(f"http://127.0.0.1:{port}")
            pids.append(proc.pid)
            if target in LLMGW:
                ADMINS.append(admin)
        yield urls, pids


def _watch_idle(engines: Sequence[str], stop: threading.Event, after: float, into: Result) -> None:
    """Every 0.25 s once the warm-up arrivals are sent, each engine's running and waiting
    requests (its own /metrics): how often one had nothing to do while another queued."""
    start = time.monotonic()
    while not stop.wait(0.25):
        if time.monotonic() - start < after:
            continue
        with contextlib.suppress(OSError, ValueError):
            samples = [_engine_samples(u) for u in engines]
            # vLLM's names, or llama-server's (the other's are absent: 0).
            running = [
                _sum(x, "vllm:num_requests_running") + _sum(x, "llamacpp:requests_processing")
                for x in samples
            ]
            waiting = [
                _sum(x, "vllm:num_requests_waiting") + _sum(x, "llamacpp:requests_deferred")
                for x in samples
            ]
            into.watched += 1
            if any(r == 0 and w == 0 for r, w in zip(running, waiting, strict=True)) and any(
                w > 0 for w in waiting
            ):
                into.idle_while_queued += 1


def _warm_engine(url: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        resp.read()


def _tree_cpu(pid: int) -> float:
    """CPU of a process and its children (llmgw-router may fork workers)."""
    total = cpu_seconds(pid)
    with contextlib.suppress(OSError):
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            total += _tree_cpu(int(child))
    return total


def run_one(
    fleet: Fleet, workload: str, target: str, args: argparse.Namespace, logs: Path, seed: int
) -> Result:
    shape: Shape = args.shape
    rate = args.rate or args.load * fleet.capacity(shape)
    times = arrival_times(rate, args.seconds, seed)
    bodies = request_bodies(workload, len(times), seed, shape, precise=bool(fleet.tokenizer))
    warm = int(len(times) * args.warmup)
    copies = 4 if workload == "tenants x4" else 1
    result = Result(workload, target, rate)
    result.loadavg = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    with contextlib.ExitStack() as stack:
        cluster: Cluster | None = None
        if args.engine == "llamacpp":
            workdir = Path(tempfile.mkdtemp(prefix="run-", dir=logs))
            cluster, engines = stack.enter_context(llamacpp_fleet_up(args, workdir))
            # The engine's first prompt (its warm-up) is not what is measured.
            for url in engines:
                _warm_engine(url)
        elif args.fleet == "control":
            workdir = Path(tempfile.mkdtemp(prefix="run-", dir=logs))
            cluster, engines = stack.enter_context(control_fleet_up(fleet, workdir))
        else:
            engines = stack.enter_context(fleet_up(fleet, logs))
        ADMINS.clear()
        urls, pids = stack.enter_context(router_up(target, engines, logs, copies, cluster))
        side = (
            [p.pid for p in (cluster.control, *cluster.agents.values()) if p is not None]
            if cluster is not None
            else []
        )
        side0 = sum(cpu_seconds(p) for p in side)
        cpu0 = sum(_tree_cpu(p) for p in pids)
        me0 = cpu_seconds(os.getpid())
        # Engine counters after the warm-up arrivals are read by a timer in the loop.
        marks: dict[str, list[dict[str, float]]] = {"before": []}

        async def main() -> tuple[list[float | None], float]:
            loop = asyncio.get_running_loop()
            if warm < len(times):
                start_at = times[warm] + 0.2

                def mark() -> None:
                    marks["before"] = [_engine_samples(u) for u in engines]

                # In a thread: the load generator's loop must not wait on the scrape.
                loop.call_later(start_at, lambda: loop.run_in_executor(None, mark))
            return await drive(urls, bodies, times, warm)

        stop = threading.Event()
        watcher = threading.Thread(
            target=_watch_idle,
            args=(engines, stop, times[warm] if warm < len(times) else 0.0, result),
        )
        watcher.start()
        try:
            results, duration = asyncio.run(main())
        finally:
            stop.set()
            watcher.join()
        result.router_cpu = sum(_tree_cpu(p) for p in pids) - cpu0
        result.loadgen_cpu = cpu_seconds(os.getpid()) - me0
        result.control_cpu = sum(cpu_seconds(p) for p in side) - side0
        after = [_engine_samples(u) for u in engines]
        for admin in ADMINS:
            with contextlib.suppress(OSError, ValueError):
                for key, value in _engine_samples(f"http://127.0.0.1:{admin}").items():
                    if key.startswith("llmgw_router_picks_total{"):
                        reason = key.split('reason="', 1)[1].split('"', 1)[0]
                        result.reasons[reason] = result.reasons.get(reason, 0) + int(value)
    before = marks["before"] or [{} for _ in after]
    counted = results[warm:]
    result.sent = len(counted)
    result.ttft = [r for r in counted if r is not None]
    result.ok = len(result.ttft)
    result.errors = result.sent - result.ok
    result.duration = duration
    queries = sum(
        _sum(a, "vllm:prefix_cache_queries_total") - _sum(b, "vllm:prefix_cache_queries_total")
        for a, b in zip(after, before, strict=True)
    )
    hits = sum(
        _sum(a, "vllm:prefix_cache_hits_total") - _sum(b, "vllm:prefix_cache_hits_total")
        for a, b in zip(after, before, strict=True)
    )
    result.hit_rate = hits / queries if queries else 0.0
    for a, b in zip(after, before, strict=True):
        q = _sum(a, "vllm:prefix_cache_queries_total") - _sum(b, "vllm:prefix_cache_queries_total")
        h = _sum(a, "vllm:prefix_cache_hits_total") - _sum(b, "vllm:prefix_cache_hits_total")
        result.per_engine_hit.append(h / q if q else 0.0)
    if args.engine == "llamacpp":
        # llama-server counts no requests; its generated tokens over the tokens per request
        # do (roughly: the warm-up request is in them), and its prompt tokens per request.
        result.per_engine = [
            round(
                (
                    _sum(a, "llamacpp:tokens_predicted_total")
                    - _sum(b, "llamacpp:tokens_predicted_total")
                )
                / shape.out
            )
            for a, b in zip(after, before, strict=True)
        ]
        evaluated = sum(
            _sum(a, "llamacpp:prompt_tokens_total") - _sum(b, "llamacpp:prompt_tokens_total")
            for a, b in zip(after, before, strict=True)
        )
        result.prompt_evaluated = evaluated / max(1, sum(result.per_engine))
    else:
        result.per_engine = [
            int(_sum(a, "vllm:request_success_total") - _sum(b, "vllm:request_success_total"))
            for a, b in zip(after, before, strict=True)
        ]
    result.all_sent = len(times)
    return result


# ----- report --------------------------------------------------------------------------


def _fmt(x: float, unit: str = "") -> str:
    return "-" if math.isnan(x) else f"{x:.0f}{unit}" if abs(x) >= 100 else f"{x:.1f}{unit}"


def _hits(r: Result) -> str:
    if math.isnan(r.prompt_evaluated):
        return f"{100 * r.hit_rate:.0f} %"
    return f"{r.prompt_evaluated:.0f} prompt tokens/req"


def table(results: Sequence[Result]) -> str:
    lines = [
        "| workload | cache | fleet | target | req/s offered | TTFT p50 | p90 | p99 | req/s done "
        "| hit rate | max/mean | idle while queued | router CPU/req | errors | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.workload} | {r.cache} | {r.fleet} | {r.target} | {r.rate:.1f} "
            f"| {_fmt(1000 * r.pct(0.5), ' ms')} "
            f"| {_fmt(1000 * r.pct(0.9), ' ms')} | {_fmt(1000 * r.pct(0.99), ' ms')} "
            f"| {r.throughput:.1f} | {_hits(r)} | {r.max_mean:.2f} "
            f"| {r.idle_while_queued}/{r.watched} "
            f"| {_fmt(r.cpu_ms_per_request, ' ms')} | {r.errors} | {r.loadavg} |"
        )
    return "\n".join(lines)


def summary(results: Sequence[Result]) -> str:
    """Medians over the repeats, per workload, cache size, fleet and target."""
    groups: dict[tuple[str, str, str, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.workload, r.cache, r.fleet, r.target), []).append(r)
    lines = [
        "| workload | cache | fleet | target | runs | TTFT p50 | p90 | req/s done | hit rate "
        "| max/mean | idle while queued | router CPU/req |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (workload, cache, fleet, target), rs in groups.items():

        def med(values: list[float]) -> float:
            return statistics.median(values)

        idle = med([r.idle_while_queued / r.watched if r.watched else 0.0 for r in rs])
        lines.append(
            f"| {workload} | {cache} | {fleet} | {target} | {len(rs)} "
            f"| {_fmt(1000 * med([r.pct(0.5) for r in rs]), ' ms')} "
            f"| {_fmt(1000 * med([r.pct(0.9) for r in rs]), ' ms')} "
            f"| {med([r.throughput for r in rs]):.1f} | {100 * med([r.hit_rate for r in rs]):.0f} % "
            f"| {med([r.max_mean for r in rs]):.2f} | {100 * idle:.1f} % "
            f"| {_fmt(med([r.cpu_ms_per_request for r in rs]), ' ms')} |"
        )
    return "\n".join(lines)


def ratios(results: Sequence[Result]) -> list[str]:
    def med(workload: str, target: str, key: str) -> float:
        vals = [
            getattr(r, key)() if callable(getattr(r, key)) else getattr(r, key)
            for r in results
            if r.workload == workload and r.target == target
        ]
        return statistics.median(vals) if vals else math.nan

    def p90(workload: str, target: str, q: float = 0.9) -> float:
        vals = [r.pct(q) for r in results if r.workload == workload and r.target == target]
        return statistics.median(vals) if vals else math.nan

    out = []
    ca = "cache_aware"
    a, b = p90("tenants", ca, 0.5), p90("tenants", "round_robin", 0.5)
    if not (math.isnan(a) or math.isnan(b)):
        out.append(f"tenants: TTFT p50 cache_aware / round_robin = {a / b:.2f}")
    for workload, other in (
        ("tenants", "round_robin"),
        ("tenants", "sglang-router"),
        ("tenants", "vllm-router"),
        ("unique", "least_outstanding"),
        ("hot", "round_robin"),
    ):
        a, b = p90(workload, ca), p90(workload, other)
        if not (math.isnan(a) or math.isnan(b)):
            out.append(f"{workload}: TTFT p90 cache_aware / {other} = {a / b:.2f}")
    one = med("tenants", ca, "hit_rate")
    four = med("tenants x4", ca, "hit_rate")
    if not (math.isnan(one) or math.isnan(four)):
        out.append(
            f"tenants x4 routers: hit rate {100 * four:.0f} % vs {100 * one:.0f} % through one"
        )
    cpu_ca = med("tenants", ca, "cpu_ms_per_request")
    cpu_lo = med("tenants", "least_outstanding", "cpu_ms_per_request")
    if not (math.isnan(cpu_ca) or math.isnan(cpu_lo)) and cpu_lo:
        out.append(
            f"tenants: router CPU/request cache_aware / least_outstanding = {cpu_ca / cpu_lo:.2f}"
        )
    for workload in TENANT_WORKLOADS:
        a, b = p90(workload, PRECISE), p90(workload, ca)
        if not (math.isnan(a) or math.isnan(b)):
            out.append(
                f"{workload}: TTFT p90 {PRECISE} / cache_aware = {a / b:.2f}; hit rate "
                f"{100 * med(workload, PRECISE, 'hit_rate'):.0f} % vs "
                f"{100 * med(workload, ca, 'hit_rate'):.0f} %"
            )
    hot = [r for r in results if r.workload == "hot" and r.target == ca]
    if hot:
        out.append(f"hot: cache_aware max/mean requests per engine = {hot[0].max_mean:.2f}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=30.0, help="arrivals per run")
    parser.add_argument("--load", type=float, default=0.75, help="of the no-cache capacity")
    parser.add_argument("--warmup", type=float, default=0.2, help="share of arrivals not counted")
    parser.add_argument("--time-scale", type=float, default=2.0)
    parser.add_argument(
        "--kv-blocks", type=int, default=1536, help="per engine (16 tokens each): ~11 prefixes"
    )
    parser.add_argument(
        "--caches",
        nargs="+",
        choices=("roomy", "tight"),
        default=["roomy", "tight"],
        help="roomy: --kv-blocks per engine; tight: a quarter of all tenants' prefixes per "
        "engine (+88 blocks for the requests in flight)",
    )
    parser.add_argument("--zipf", type=float, default=1.0, help="zipf: the popularity exponent")
    parser.add_argument("--conversations", type=int, default=64, help="multiturn: open at once")
    parser.add_argument("--turns", type=int, default=8, help="multiturn: turns per conversation")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument(
        "--targets", nargs="+", default=[*LLMGW, *PEER_TARGETS], choices=[*LLMGW, *PEER_TARGETS]
    )
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--cache-aware-epsilon",
        type=float,
        help="bounded-load epsilon for llmgw's cache_aware (default: the router's own)",
    )
    parser.add_argument(
        "--cache-aware-slack",
        type=float,
        help="bounded-load slack (requests) for llmgw's cache_aware (default: the router's own)",
    )
    parser.add_argument(
        "--fleet",
        dest="fleets",
        nargs="+",
        choices=("control", "static"),
        default=["control"],
        help="one or both, alternating; control: engines launched by llmgw-agent under llmgw-control, llmgw routers "
        "fed by its endpoint and load streams; static: engines started directly, llmgw "
        "routers with static endpoints and their own counts only",
    )
    parser.add_argument(
        "--engine",
        choices=("sim", "llamacpp"),
        default="sim",
        help="llamacpp: real llama-server replicas (CPU) of the small GGUF model through the "
        "control fleet; give --rate and a smaller --tenants/--system-words",
    )
    parser.add_argument("--rate", type=float, help="requests/s offered (default: from --load)")
    parser.add_argument("--tenants", type=int, default=TENANTS)
    parser.add_argument("--system-words", type=int, default=SYSTEM_TOKENS)
    parser.add_argument("--user-words", type=int, default=USER_TOKENS)
    parser.add_argument("--out-tokens", type=int, default=OUT_TOKENS)
    parser.add_argument("--llama-server", help="llamacpp: the llama-server binary")
    parser.add_argument("--gguf", help="llamacpp: the model file")
    parser.add_argument("--cpu-threads", type=int, default=1, help="llamacpp: per replica")
    parser.add_argument(
        "--llama-args",
        default="-c 4096 --parallel 2 --cache-ram 0",
        help="llamacpp: the profile's engine_args (default: 2 slots, each its own prompt "
        "cache, no host-memory cache shared by the slots)",
    )
    parser.add_argument(
        "--precise",
        action="store_true",
        help="the simulated engines tokenize with a real (word-level) tokenizer and publish "
        "KV events with token ids, and target cache_aware+tokens matches on them (tenant "
        "workloads a, d, e; the control fleet)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    args.shape = Shape(args.tenants, args.system_words, args.user_words, args.out_tokens)
    if args.cache_aware_epsilon is not None:
        CACHE_AWARE["epsilon"] = args.cache_aware_epsilon
    if args.cache_aware_slack is not None:
        CACHE_AWARE["slack"] = args.cache_aware_slack
    use_uvloop()
    SKEW.update(zipf=args.zipf, conversations=args.conversations, turns=args.turns)
    fleet = Fleet(args.engines, args.time_scale, args.kv_blocks)
    system_blocks = math.ceil(args.shape.system / fleet.block_size)
    kv_blocks = {
        "roomy": args.kv_blocks,
        "tight": math.ceil(args.shape.tenants * system_blocks / 4) + 88,
    }
    # The tenants' prompt bytes per token (a word), as an operator would configure it.
    sample = _words("t10", args.shape.system)
    bytes_per_token = round((len(sample) + 1) / args.shape.system, 2)
    if args.precise:
        if args.engine != "sim" or args.fleets != ["control"]:
            parser.error("--precise needs the simulated engines under the control fleet")
        if any(WORKLOADS[k] not in TENANT_WORKLOADS for k in args.workloads):
            parser.error("--precise runs the tenant workloads only: --workloads a d e")
        folder = Path(tempfile.mkdtemp(prefix="bench-tokenizer-"))
        atexit.register(shutil.rmtree, folder, True)
        write_word_tokenizer(folder, vocabulary(args.shape))
        TOKENIZER.append(str(folder))
        fleet = dataclasses.replace(fleet, tokenizer=str(folder))
    elif PRECISE in args.targets:
        if "--targets" in (argv if argv is not None else sys.argv):
            parser.error(f"{PRECISE} needs --precise")
        args.targets = [t for t in args.targets if t != PRECISE]
    if args.engine == "llamacpp":
        args.fleets = ["control"]
        if args.rate is None:
            parser.error("--engine llamacpp needs --rate (requests/s the replicas can serve)")
    targets = [t for t in args.targets if t in LLMGW or (PEERS / t).exists()]
    for t in set(args.targets) - set(targets):
        print(f"# {t}: not installed under {PEERS}, skipped", file=sys.stderr)
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        logs = Path(tmp)
        for rep in range(args.repeat):
            for key in args.workloads:
                workload = WORKLOADS[key]
                order = (
                    [t for t in targets if t in ("cache_aware", PRECISE)]
                    if workload == "tenants x4"
                    else targets
                )
                order = order[rep % len(order) :] + order[: rep % len(order)]
                for cache in args.caches:
                    sized = dataclasses.replace(fleet, kv_blocks=kv_blocks[cache])
                    CACHE_TOKENS[:] = [sized.kv_blocks * sized.block_size]
                    if "bytes_per_token" not in CACHE_AWARE and not args.precise:
                        CACHE_AWARE["bytes_per_token"] = bytes_per_token
                    for fleet_kind in args.fleets:
                        args.fleet = fleet_kind
                        for target in order:
                            seed = args.seed + 1000 * rep + ord(key)
                            r = run_one(sized, workload, target, args, logs, seed)
                            r.cache, r.fleet = cache, fleet_kind
                            results.append(r)
                            print(
                                f"# {workload} {cache} {fleet_kind} {target} [load {r.loadavg}]: "
                                f"{r.ok}/{r.sent} ok, p50 {_fmt(1000 * r.pct(0.5), ' ms')}, "
                                f"p90 {_fmt(1000 * r.pct(0.9), ' ms')}, "
                                f"p99 {_fmt(1000 * r.pct(0.99), ' ms')}, "
                                f"{r.throughput:.1f} req/s, hit {100 * r.hit_rate:.0f} %, "
                                f"per engine {r.per_engine} "
                                f"hit {[round(100 * h) for h in r.per_engine_hit]} %, idle "
                                f"{r.idle_while_queued}/{r.watched}, router CPU "
                                f"{_fmt(r.cpu_ms_per_request, ' ms')}/req, load generator CPU "
                                f"{r.loadgen_cpu / max(r.duration, 1e-9):.0%} of one core, "
                                f"control+agent {r.control_cpu / max(r.duration, 1e-9):.0%}"
                                + (f", picks {r.reasons}" if r.reasons else ""),
                                file=sys.stderr,
                                flush=True,
                            )
    if args.json:
        print(json.dumps([r.row() for r in results], indent=1))
    else:
        if args.engine == "llamacpp":
            print(
                f"fleet (control): {args.engines} real llama-server replicas, "
                f"{args.cpu_threads} thread(s) each, engine_args {args.llama_args!r}; "
                f"{args.rate:g} req/s offered; {args.shape}"
            )
        else:
            print(
                f"fleet ({', '.join(args.fleets)}): {fleet.engines} simulated vLLM engines, prefill "
                f"{fleet.prefill_rate:g} tokens/s, step {1000 * fleet.step_time:g} ms + "
                f"{1000 * fleet.decode_seq_time:g} ms/sequence, KV "
                f"{', '.join(f'{c} {kv_blocks[c]}' for c in args.caches)} blocks x "
                f"{fleet.block_size}; no-cache capacity {fleet.capacity(args.shape):.1f} req/s; "
                f"{args.shape}"
            )
        print(table(results))
        print()
        print(summary(results))
        for cache in args.caches:
            for fleet_kind in args.fleets:
                picked = [r for r in results if r.cache == cache and r.fleet == fleet_kind]
                for line in ratios(picked):
                    print(f"{cache} cache, {fleet_kind} fleet: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
