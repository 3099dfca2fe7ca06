"""What share of bench_lora's requests any placement could serve from a holder (issue 30).

    python tools/bench/lora_offline.py                       # Zipf 1.5, 60 s warm-up, seeds 1-6
    python tools/bench/lora_offline.py --zipf 1.2 --warmup 30

The same seeded arrivals as `bench_lora.py` (its `arrivals` and `popularity`), replayed
against the fleet's adapter slots (`--replicas` x `--max-loras`) taken as one cache, with
loads that take no time, so each figure is an upper bound for its policy on the real fleet:

- `clairvoyant`: Belady's rule (unload the adapter asked for again furthest in the
  future), the most any placement can serve from a holder on these arrivals;
- `lru`: unload the least recently used;
- `pinned P`: the P most popular adapters (by the law the arrivals are drawn from, known
  exactly) always held, the other slots an LRU for the rest: the rule llmgw's control
  plane follows with its spare pool, with rates it must measure instead.

The share is of the requests after the warm-up that found their adapter held.
"""

from __future__ import annotations

import argparse
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence

from bench_lora import Args, args_of, arrivals, popularity, workload_args

Arrivals = Sequence[tuple[float, str]]


def clairvoyant(reqs: Arrivals, slots: int, warmup: float) -> float:
    """Belady: on a miss with every slot taken, unload what is asked for again last."""
    next_use = [0] * len(reqs)
    seen: dict[str, int] = {}
    for i in range(len(reqs) - 1, -1, -1):
        next_use[i] = seen.get(reqs[i][1], len(reqs))
        seen[reqs[i][1]] = i
    held: dict[str, int] = {}
    hits = measured = 0
    for i, (at, adapter) in enumerate(reqs):
        counted = at >= warmup
        if adapter in held:
            hits += counted
        elif len(held) >= slots:
            del held[max(held, key=held.__getitem__)]
        held[adapter] = next_use[i]
        measured += counted
    return hits / max(1, measured)


def pinned_lru(reqs: Arrivals, slots: int, warmup: float, pinned: frozenset[str]) -> float:
    """``pinned`` always held; the other slots an LRU for the rest."""
    held: OrderedDict[str, None] = OrderedDict()
    hits = measured = 0
    for at, adapter in reqs:
        counted = at >= warmup
        measured += counted
        if adapter in pinned:
            hits += counted
        elif adapter in held:
            hits += counted
            held.move_to_end(adapter)
        else:
            if len(held) >= slots - len(pinned):
                held.popitem(last=False)
            held[adapter] = None
    return hits / max(1, measured)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_args(parser)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--pinned", type=int, nargs="+", default=[12, 15])
    ns = parser.parse_args(argv)
    slots = ns.replicas * ns.max_loras
    if not all(0 < p < slots for p in ns.pinned):
        parser.error(f"--pinned: each must be between 1 and {slots - 1} (the slots less one)")
    policies: list[tuple[str, Callable[[Args, Arrivals], float]]] = [
        ("clairvoyant", lambda a, r: clairvoyant(r, slots, a.warmup)),
        ("lru", lambda a, r: pinned_lru(r, slots, a.warmup, frozenset())),
    ]
    for p in ns.pinned:

        def top(a: Args, r: Arrivals, p: int = p) -> float:
            return pinned_lru(r, slots, a.warmup, frozenset(popularity(a)[:p]))

        policies.append((f"pinned {p}", top))
    print(
        f"Zipf {ns.zipf}, {ns.adapters} adapters, {slots} slots, {ns.rate}/s, "
        f"{ns.duration:g} s after a {ns.warmup:g} s warm-up: requests that found a holder"
    )
    print("| policy | " + " | ".join(f"seed {s}" for s in ns.seeds) + " |")
    print("|---|" + "---|" * len(ns.seeds))
    runs = [(a, arrivals(a)) for a in (args_of(ns, seed, load_time=0.0) for seed in ns.seeds)]
    for name, policy in policies:
        shares = [policy(a, reqs) for a, reqs in runs]
        print(f"| {name} | " + " | ".join(f"{s * 100:.1f} %" for s in shares) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
