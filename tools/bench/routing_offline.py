"""An offline model of bench_routing's tight-cache tenants run (issue 26): a few seconds,
no processes, to see where several routers' homes put each tenant.

The routers are `CacheAware` balancers fed the benchmark's requests in turn (as the
benchmark's load generator sends them round robin), each placing by the request's
prefix blocks as the router does; every second each router's recent keys go through the
control plane's own `merge` and back (`share_keys`), as SharePrefixes does. The engines
are LRU caches of `1,088` blocks of 16 tokens (a tenant's system prompt 125 blocks, a
request's own tail 3), prefilling 10,000 tokens/s and decoding 16 tokens in 16 ms steps;
a router sees each engine's requests in flight as its load. A model, not the benchmark:
no engine reports, timing or bounded waits; its hit rate is per request (the tenant's
prefix cached or not). It prints the hit rate, each engine's requests and hits, the
picks by reason, and how many tenants went to more than one engine in their last 8
requests; `--tenants` prints each tenant's engines in order, `--trace tN` each pick of
one tenant (router, engine, reason, the fleet's holder and this router's home).

    python tools/bench/routing_offline.py [--routers 4] [--seed 1] [--no-fit-holders]
        [--kv-blocks 1536 (roomy; default tight)] [--workload tenants|zipf|"tenants x4"]
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Sequence

import msgspec
from llmgw_control.prefixes import merge
from llmgw_router.balancing import CacheAware
from llmgw_router.balancing.prefix import prefix_blocks, prompt_text
from llmgw_testkit.candidates import Cand, usable
from routing_workloads import (
    Shape,
    arrival_times,
    request_bodies,
    tight_kv_blocks,
    words_bytes_per_token,
)

BLOCK_TOKENS = 16
ENGINES = 4
BLOCK_BYTES = 256  # cache_aware's default block_bytes
PREFILL = 10_000.0  # tokens/s
STEP = 0.016


class Engine:
    """An LRU of cached items (a tenant's prefix, a request's tail), in blocks."""

    def __init__(self, blocks: int, prefix_blocks: int) -> None:
        self.blocks = blocks
        self.prefix_blocks = prefix_blocks
        self.lru: collections.OrderedDict[object, int] = collections.OrderedDict()
        self.used = 0
        self.ends: list[float] = []
        self.prefill_free = 0.0

    def serve(self, tenant: str, request: int, at: float, prompt_tokens: int) -> bool:
        hit = tenant in self.lru
        if hit:
            self.lru.move_to_end(tenant)
        else:
            self.lru[tenant] = self.prefix_blocks
            self.used += self.prefix_blocks
        self.lru[request] = 3
        self.used += 3
        while self.used > self.blocks:
            self.used -= self.lru.popitem(last=False)[1]
        miss = prompt_tokens if not hit else prompt_tokens - self.prefix_blocks * BLOCK_TOKENS
        self.prefill_free = max(at, self.prefill_free) + miss / PREFILL
        self.ends.append(self.prefill_free + 16 * (STEP + 0.0002 * len(self.ends)))
        return hit


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--routers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=13.5, help="requests/s offered")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--warmup", type=float, default=0.2, help="share of arrivals not counted")
    parser.add_argument(
        "--kv-blocks", type=int, default=0, help="per engine (0: the tight cache; 1536 roomy)"
    )
    parser.add_argument("--workload", default="tenants x4", help="tenants, tenants x4, zipf")
    parser.add_argument("--no-fit-holders", action="store_true", help="the rule before")
    parser.add_argument("--no-share", action="store_true", help="the routers do not share")
    parser.add_argument("--tenants", action="store_true", help="each tenant's engines")
    parser.add_argument("--trace", default="", help="each pick of this tenant (t0, t1, ...)")
    args = parser.parse_args(argv)
    shape = Shape()
    system_blocks = -(-shape.system // BLOCK_TOKENS)
    kv_blocks = args.kv_blocks or tight_kv_blocks(shape, BLOCK_TOKENS)
    bytes_per_token = words_bytes_per_token(shape)
    cache_blocks = int(kv_blocks * BLOCK_TOKENS / (BLOCK_BYTES / bytes_per_token))
    times = arrival_times(args.rate, args.seconds, args.seed)
    bodies = request_bodies(args.workload, len(times), args.seed, shape)
    shared = args.routers > 1
    routers = [
        CacheAware[Cand](shared_homes=shared, fit_holders=not args.no_fit_holders)
        for _ in range(args.routers)
    ]
    views = [[Cand(f"e{i}", cache_blocks=cache_blocks) for i in range(ENGINES)] for _ in routers]
    engines = [Engine(kv_blocks, system_blocks) for _ in range(ENGINES)]
    reports: dict[int, dict[str, dict[int, tuple[int, int, str]]]] = {}
    next_share = [1.0 + r / args.routers for r in range(args.routers)]
    warm = int(args.warmup * len(times))
    counted = hits = 0
    per = [0] * ENGINES
    per_hit = [0] * ENGINES
    reasons: collections.Counter[str] = collections.Counter()
    sent: dict[str, list[int]] = collections.defaultdict(list)
    for i, (at, body) in enumerate(zip(times, bodies, strict=True)):
        for r, router in enumerate(routers):
            while shared and not args.no_share and at >= next_share[r]:
                reports[r] = {"": router.recent_keys()}
                router.share_keys(merge(reports.values()).get("", {}))
                next_share[r] += 1.0
        for e, engine in enumerate(engines):
            engine.ends = [end for end in engine.ends if end > at]
            for view in views:
                view[e].load = len(engine.ends)
        r = i % args.routers
        messages = msgspec.json.decode(body)["messages"]
        prefix = prefix_blocks(
            prompt_text(msgspec.json.encode(messages), chat=True), BLOCK_BYTES, 256
        )
        tenant = messages[0]["content"].split("w", 1)[0]
        pick = routers[r].choose(views[r], usable, None, prefix, at=at)
        assert pick.endpoint is not None
        e = int(pick.endpoint.id[1:])
        reasons[pick.reason] += 1
        hit = engines[e].serve(tenant, i, at, shape.prompt_tokens)
        if tenant == args.trace:
            key = prefix[min(len(prefix), routers[r].affinity_blocks) - 1]
            home = routers[r]._home(views[r], key, prefix) if shared else None
            print(
                f"{at:6.2f} s router {r} -> e{e} {pick.reason:14} hit {hit!s:5} "
                f"fleet {routers[r].fleet_keys().get(key)} home e{home} "
                f"loads {[c.load for c in views[r]]}"
            )
        if i >= warm:
            counted += 1
            hits += hit
            per[e] += 1
            per_hit[e] += hit
            sent[tenant].append(e)
    split = sum(1 for engines_sent in sent.values() if len(set(engines_sent[-8:])) > 1)
    rule = "before" if args.no_fit_holders else "fit_holders"
    print(
        f"routers {args.routers} ({rule}{', not sharing' if args.no_share else ''}), seed "
        f"{args.seed}: hit {100 * hits / max(1, counted):.1f} %, per engine {per} hit "
        f"{[round(100 * h / max(1, n)) for h, n in zip(per_hit, per, strict=True)]} %, "
        f"max/mean {max(per) * len(per) / max(1, sum(per)):.2f}, "
        f"tenants on 2+ engines in their last 8: {split}, picks {dict(reasons)}"
    )
    if args.tenants:
        for name in sorted(sent, key=lambda t: int(t[1:])):
            print(f"{name:4} {''.join(str(e) for e in sent[name])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
