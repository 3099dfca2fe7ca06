"""bench_routing's processes: the fleet of engines (simulated vLLM started directly, or
launched by llmgw-agent under llmgw-control, or real llama-server replicas) and the
routers in front of it (llmgw-router, sglang-router, vllm-router)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import sys
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchlib import serving
from llmgw_sim.metrics import parse_prometheus
from llmgw_testkit import free_port, http_get, wait_for
from llmgw_testkit.cluster import Cluster, vllm_profile
from llmgw_testkit.serving_checks import engine_secret
from routing_workloads import MODEL, Shape, make_words

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PEERS = ROOT / ".cache" / "bench-routing" / "bin"

LLMGW = ("round_robin", "least_outstanding", "cache_aware", "cache_aware+tokens")
# cache_aware with precise matching: cache_aware.tokenizers names the engines' tokenizer
# (--precise: the simulated engines tokenize with a real word-level tokenizer and publish
# KV events with token ids; the router tokenizes prompts with the same files).
PRECISE = "cache_aware+tokens"
PEER_TARGETS = ("sglang-router", "vllm-router")
CACHE_TOKENS: list[int] = []
# The admin ports of the llmgw routers of the current run (for their picks' reasons).
ADMINS: list[int] = []
# Words of the user turns when a real tokenizer reads them (--precise): in its vocabulary.
# --cache-aware-epsilon / --cache-aware-slack: the bounded-load settings given to llmgw's
# cache_aware (the router's defaults for those not set).
CACHE_AWARE: dict[str, float] = {}
# --precise: the tokenizer folder the engines and cache_aware+tokens load.
TOKENIZER: list[str] = []
# Other settings of llmgw's routers (--engine vllm: deadlines for prefills of a minute
# and more on a busy two-core machine, which the defaults would count as failures).
ROUTER_EXTRA: dict[str, object] = {}


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


def engine_samples(url: str) -> dict[str, float]:
    status, body = http_get(url + "/metrics", timeout=10)
    return parse_prometheus(body.decode()) if status == 200 else {}


def sum_metric(samples: dict[str, float], name: str) -> float:
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


VLLM_EXE = ROOT / ".cache" / "engines" / "vllm-0.32.0" / "bin" / "vllm"
HF_MODEL = ROOT / ".cache" / "models" / "gemma3-270m-hf"


def real_vllm_profile(args: argparse.Namespace) -> dict[str, object]:
    """``--engines`` real vLLM (CPU) replicas of gemma-3 270M: prefix caching on (vLLM's
    default), ``--kv-cache-memory-bytes`` each, one OpenMP thread each (unbound: the
    kernel puts the two replicas on the two cores), the dev routes on so that the
    bench can reset each replica's prefix cache between runs."""
    return {
        "engine": "vllm",
        "model_ref": str(args.hf_model),
        "engine_args": [
            *("--kv-cache-memory-bytes", args.kv_cache_bytes),
            *args.vllm_args.split(),
        ],
        "env": {
            "HF_HUB_OFFLINE": "1",
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": str(args.cpu_threads),
            # POST /reset_prefix_cache (not under /v1: the agent's key does not guard it).
            "VLLM_SERVER_DEV_MODE": "1",
        },
        "gpus_per_node": 0,
        "served_model_names": [MODEL],
        "replicas": args.engines,
        "load_timeout": "900s",
    }


@contextlib.contextmanager
def vllm_fleet_up(args: argparse.Namespace, workdir: Path) -> Iterator[tuple[Cluster, list[str]]]:
    """``--engines`` real vLLM (CPU) replicas launched by ``llmgw-agent`` under
    ``llmgw-control`` (tests-real-vllm's way), started once for every run of the bench:
    a start costs minutes on two cores, so the runs reset the prefix caches instead."""
    exe, model = Path(args.vllm), Path(args.hf_model)
    if not exe.exists() or not (model / "config.json").exists():
        raise SystemExit(
            f"bench_routing --engine vllm: no vLLM at {exe} or model at {model} "
            "(run `nox -s real_vllm -- -k nothing` once, or pass --vllm and --hf-model)"
        )
    # The agent reads the engine's version and help in its own environment: vllm-cpu
    # dies of SIGILL at import on this CPU without it.
    saved = os.environ.get("VLLM_TARGET_DEVICE")
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    timings = {"load_interval": "250ms", "unreachable_after": "20s", "lost_after": "900s"}
    try:
        with Cluster(workdir, insecure=True, timings=timings) as cluster:
            cluster.start_control([{"name": MODEL, "profiles": {"cpu": real_vllm_profile(args)}}])
            cluster.start_agent(
                "cpu-0",
                simulate_gpus=None,
                engines={"vllm": {"command": [str(exe)]}},
                stop_engines_on_exit=True,
                stop_grace="30s",
            )
            replicas = cluster.wait_replicas(MODEL, args.engines, timeout=900)
            for replica in replicas:
                # The first request of an engine is slow (its warm-up): not measured.
                (shard,) = replica["shards"]
                _warm(str(replica["endpoint"]), engine_secret(shard["pid"], "VLLM_API_KEY"))
            yield cluster, sorted(str(r["endpoint"]) for r in replicas)
    finally:
        if saved is None:
            os.environ.pop("VLLM_TARGET_DEVICE", None)
        else:
            os.environ["VLLM_TARGET_DEVICE"] = saved


def real_bytes_per_token(args: argparse.Namespace) -> float:
    """The tenants' system prompt's bytes per token of the model's own tokenizer (what
    cache_aware's ``bytes_per_token`` is for: an engine's cache in tokens as bytes)."""
    from tokenizers import Tokenizer

    sample = " " + make_words("t10", args.shape.system)
    tokens = Tokenizer.from_file(str(Path(args.hf_model) / "tokenizer.json")).encode(sample)
    return round(len(sample.encode()) / len(tokens.ids), 2)


def vllm_caches(engines: Sequence[str]) -> list[str]:
    """Each engine's KV cache as it reports it (``vllm:cache_config_info``)."""
    out = []
    for url in engines:
        _, body = http_get(url + "/metrics", timeout=10)
        lines = body.decode().splitlines()
        line = [x for x in lines if x.startswith("vllm:cache_config_info")]
        info = dict(re.findall(r'(\w+)="([^"]*)"', line[0])) if line else {}
        out.append(
            f"{info.get('kv_cache_size_tokens', '?')} tokens ({info.get('num_gpu_blocks', '?')} "
            f"blocks of {info.get('block_size', '?')} shared by the KV groups)"
        )
    return out


def _warm(url: str, key: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        resp.read()


def reset_prefix_caches(engines: Sequence[str]) -> None:
    """Empty every engine's prefix cache (vLLM's dev route), so that no run inherits the
    previous run's cached prompts; vLLM refuses while blocks are held: retried."""

    def reset(url: str) -> bool:
        req = urllib.request.Request(url + "/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            return bool(json.loads(resp.read()).get("success"))

    for url in engines:
        wait_for(functools.partial(reset, url), timeout=60, what=f"{url}: prefix cache reset")


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
                                        # Several routers in front of one fleet: the
                                        # homes every router computes alike.
                                        **({"shared_homes": True} if copies > 1 else {}),
                                    }
                                }
                                if target in ("cache_aware", PRECISE)
                                else {}
                            ),
                            **source,
                            **ROUTER_EXTRA,
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
