"""Prefill/decode disaggregation (issue 32): 2 prefill + 2 decode engines against 4 aggregated.

    python tools/bench/bench_disagg.py                       # long and short mixes
    python tools/bench/bench_disagg.py --seconds 20 --mixes long

The same four simulated vLLM engines (``llmgw-sim vllm serve``, step scheduler: a token
budget per step, chunked prefill, continuous batching), started fresh for every run,
behind one ``llmgw-router`` (static endpoints, ``least_outstanding``) either as four
aggregated replicas or as two prefill and two decode replicas (``role``), the router
running the two-phase exchange (proxy/disagg.py) and the simulators vLLM's protocol
(llmgw_sim.kvtransfer: a decode engine computes only the prompt's last token, after
``--transfer-per-token`` seconds a token). Open-loop Poisson arrivals of streaming chat
completions, unique prompts (no prefix-cache help either way):

- ``long``: ``--long-prompt`` (8,192) prompt tokens, ``--long-out`` (256) output tokens;
- ``short``: 256 prompt tokens, 64 output tokens.

The rate is ``--load`` of the disaggregated fleet's capacity (its two prefill engines'
prefill rate, the bottleneck of a prefill-heavy mix), so both fleets see the same
requests. ``--budget`` is the aggregated engines' ``--max-num-batched-tokens`` (and the
decode engines'); the prefill engines have their own (``--prefill-budget``, as a
disaggregated profile's prefill pool has its own engine_args). Reported per run: ITL p90,
p99 and max (gaps between a stream's content chunks, all streams), TTFT p90, requests/s
(completed over the first counted arrival to the last completion) and sustained
requests/s (completed while arrivals still came: a fleet that keeps up completes them at
the arrival rate, and a longer TTFT does not lower it) and output tokens/s; the first
``--warmup`` share of arrivals is sent but not counted.

    python tools/bench/bench_disagg.py --seconds 60 --mixes long --budget 512 1024 --load 0.6 0.75 0.9
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from benchlib import serving
from llmgw_testkit import free_port

BIN = Path(sys.executable).parent
MODEL = "m"
PREFILL_RATE = 20000.0  # the simulator's default, tokens/s


@contextlib.contextmanager
def engines(budgets: list[int], scale: float, transfer: float, logs: Path) -> Iterator[list[str]]:
    """One engine per entry of ``budgets``, each its ``--max-num-batched-tokens``."""
    with contextlib.ExitStack() as stack:
        urls = []
        for i, budget in enumerate(budgets):
            port = free_port()
            argv = [str(BIN / "llmgw-sim"), "vllm", "serve", "org/model", "--host",
                    "127.0.0.1", "--port", str(port), "--served-model-name", MODEL,
                    "--max-model-len", "16384", "--num-gpu-blocks-override", "8192",
                    "--sim-scheduler", "step", "--sim-seed", str(i),
                    "--sim-prefill-rate", f"{PREFILL_RATE / scale:g}",
                    "--sim-step-time", f"{0.008 * scale:g}",
                    "--sim-decode-seq-time", f"{0.0001 * scale:g}",
                    "--sim-kv-transfer-per-token", f"{transfer:g}",
                    "--max-num-batched-tokens", str(budget),
                    "--sim-name", f"e{i}"]  # fmt: skip
            url = f"http://127.0.0.1:{port}"
            stack.enter_context(
                serving(
                    argv,
                    health=url + "/health",
                    what="llmgw-sim",
                    log_dir=logs,
                    name=f"engine{i}",
                    timeout=60,
                )
            )
            urls.append(url)
        yield urls


@contextlib.contextmanager
def router(urls: list[str], disagg: bool, logs: Path, min_prompt: int = 0) -> Iterator[str]:
    port, admin = free_port(), free_port()
    entries: list[dict[str, Any]] = []
    for i, url in enumerate(urls):
        entry: dict[str, Any] = {"id": f"e{i}", "url": url, "models": [MODEL]}
        if disagg:
            entry.update(role="prefill" if i < len(urls) // 2 else "decode", engine="vllm")
            entry["profile"] = entry["role"]
        entries.append(entry)
    config = {
        "listen": f"127.0.0.1:{port}",
        "admin_listen": f"127.0.0.1:{admin}",
        "workers": 1,
        "balancer": "least_outstanding",
        "deadlines": {"first_byte": "600s", "total": "900s", "idle": "600s"},
        "endpoints": entries,
        "disagg": {"min_prompt_tokens": min_prompt},
    }
    path = logs / f"router-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = [str(BIN / "llmgw-router"), "serve", "--config", str(path)]
    with serving(argv, health=f"http://127.0.0.1:{admin}/readyz", what="llmgw-router",
                 log_dir=logs, name="router", timeout=60):  # fmt: skip
        yield f"http://127.0.0.1:{port}"


def prompt(rng: random.Random, tokens: int) -> str:
    # The simulator counts a word a token: unique words, so no prefix is shared.
    return " ".join(f"w{rng.getrandbits(40):x}" for _ in range(tokens))


async def one(session: aiohttp.ClientSession, url: str, body: bytes, out: dict[str, Any]) -> None:
    sent = time.monotonic()
    chunks: list[float] = []
    async with session.post(url + "/v1/chat/completions", data=body,
                            headers={"Content-Type": "application/json"}) as resp:  # fmt: skip
        out["status"] = resp.status
        async for line in resp.content:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                choices = event.get("choices") or []
                if choices and choices[0].get("delta", {}).get("content"):
                    chunks.append(time.monotonic())
    out["ttft"] = chunks[0] - sent if chunks else None
    out["gaps"] = [b - a for a, b in itertools.pairwise(chunks)]
    out["tokens"] = len(chunks)
    out["done"] = time.monotonic()


async def drive(url: str, rate: float, seconds: float, shape: tuple[int, int], seed: int
                ) -> tuple[list[dict[str, Any]], float, float]:  # fmt: skip
    rng = random.Random(seed)
    n = max(1, int(rate * seconds))
    bodies = [
        json.dumps({"model": MODEL, "stream": True, "max_tokens": shape[1], "ignore_eos": True,
                    "messages": [{"role": "user", "content": prompt(rng, shape[0])}]}).encode()
        for _ in range(n)
    ]  # fmt: skip
    results: list[dict[str, Any]] = [{} for _ in range(n)]
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.monotonic()
        tasks = []
        at = 0.0
        for i in range(n):
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            results[i]["sent"] = time.monotonic()
            tasks.append(asyncio.create_task(one(session, url, bodies[i], results[i])))
            at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return results, start, time.monotonic()


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarise(results: list[dict[str, Any]], warmup: float) -> dict[str, float]:
    counted = results[int(len(results) * warmup) :]
    ok = [r for r in counted if r.get("status") == 200 and r.get("ttft") is not None]
    gaps = [g for r in ok for g in r["gaps"]]
    first, last = min(r["sent"] for r in counted), max(r["done"] for r in ok)
    span = max(last - first, 1e-9)
    # Sustained throughput: requests (any, warm-up included) completed while arrivals
    # still came, from the first counted arrival to the last arrival. A fleet that keeps
    # up completes them at the arrival rate; one that falls behind, at its capacity. The
    # plain req/s above also counts the drain after the last arrival, so a fleet with a
    # longer TTFT shows fewer req/s even when it keeps up.
    end = max(r["sent"] for r in results)
    window = max(end - first, 1e-9)
    done = [r for r in results if r.get("status") == 200 and first <= r.get("done", -1.0) <= end]
    return {
        "requests": len(counted),
        "ok": len(ok),
        "itl_p90_ms": pct(gaps, 0.9) * 1000,
        "itl_p99_ms": pct(gaps, 0.99) * 1000,
        "itl_max_ms": max(gaps, default=float("nan")) * 1000,
        "ttft_p90_s": pct([r["ttft"] for r in ok], 0.9),
        "req_s": len(ok) / span,
        "sustained_req_s": len(done) / window,
        "tok_s": sum(r["tokens"] for r in ok) / span,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument(
        "--load",
        type=float,
        nargs="+",
        default=[0.75],
        help="share(s) of the 2P+2D fleet's capacity, one run pair each",
    )
    parser.add_argument("--budget", type=int, nargs="+", default=[8192],
                        help="--max-num-batched-tokens of the aggregated engines and of the "
                        "decode engines (vLLM V1: 8192 on an H100 serving, 2048 on a smaller "
                        "GPU; V0 with chunked prefill: 512), one run pair each")  # fmt: skip
    parser.add_argument("--prefill-budget", type=int, default=8192,
                        help="--max-num-batched-tokens of the 2P+2D fleet's prefill engines "
                        "(the prefill pool's own engine_args: no stream decodes there, so "
                        "nothing asks for small steps)")  # fmt: skip
    parser.add_argument("--time-scale", type=float, default=2.0)
    parser.add_argument("--transfer-per-token", type=float, default=0.000005)
    parser.add_argument("--long-prompt", type=int, default=8192)
    parser.add_argument("--long-out", type=int, default=256)
    parser.add_argument(
        "--min-prompt-tokens",
        type=int,
        default=0,
        help="the router's disagg.min_prompt_tokens (estimated: body bytes / 4): shorter "
        "prompts go to a decode engine alone",
    )
    parser.add_argument("--warmup", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--mixes", nargs="+", default=["long", "short"], choices=["long", "short"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    shapes = {"long": (args.long_prompt, args.long_out), "short": (256, 64)}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-disagg-") as tmp:
        logs = Path(tmp)
        for mix in args.mixes:
            p, o = shapes[mix]
            prefill_s = p / (PREFILL_RATE / args.time_scale)
            # Two prefill engines' capacity (the disaggregated fleet's bottleneck when
            # prefill-heavy); for short prompts the decode side bounds it sooner.
            decode_s = o * 0.008 * args.time_scale / 16  # ~16 streams batched per engine
            for budget, load, disagg in itertools.product(args.budget, args.load, (False, True)):
                rate = load * 2 / max(prefill_s, decode_s)
                prefill_budget = args.prefill_budget
                budgets = [prefill_budget] * 2 + [budget] * 2 if disagg else [budget] * 4
                with engines(budgets, args.time_scale, args.transfer_per_token, logs) as urls, \
                        router(urls, disagg, logs, args.min_prompt_tokens) as url:  # fmt: skip
                    results, _, _ = asyncio.run(drive(url, rate, args.seconds, (p, o), args.seed))
                row = {"mix": mix, "fleet": "2P+2D" if disagg else "4 aggregated",
                       "rate": rate, "load": load, "budget": budget,
                       "prefill_budget": prefill_budget if disagg else budget,
                       "min_prompt_tokens": args.min_prompt_tokens, **summarise(results, args.warmup)}  # fmt: skip
                rows.append(row)
                budget_text = f"{budget}" + (f"/P {prefill_budget}" if disagg else "")
                print(json.dumps(row) if args.json else
                      f"{mix:5} budget {budget_text:10} load {load:.2f} {row['fleet']:13} rate {rate:5.2f}/s  ok {row['ok']}/{row['requests']}"
                      f"  ITL p90 {row['itl_p90_ms']:6.1f} p99 {row['itl_p99_ms']:6.1f} max {row['itl_max_ms']:6.0f} ms  TTFT p90 {row['ttft_p90_s']:6.2f} s"
                      f"  {row['req_s']:5.2f} req/s ({row['sustained_req_s']:5.2f} sustained)  {row['tok_s']:7.1f} tok/s", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
