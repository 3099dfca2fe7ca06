"""bench_routing's workloads: the requests' shapes, their JSON bodies (tenants, unique,
hot, zipf, multi-turn conversations) and their Poisson arrival times."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

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
# Words of the user turns when a real tokenizer reads them (--precise): in its vocabulary.
USER_VOCABULARY = 5000


def make_words(prefix: str, n: int) -> str:
    # One simulator token per word ("t3w17" with its leading space).
    return " ".join(f"{prefix}w{i}" for i in range(n))


def tight_kv_blocks(shape: Shape, block_tokens: int) -> int:
    """The tight cache per engine: a quarter of all the tenants' prefixes, plus 88 blocks
    for the requests in flight (1,088 blocks of 16 tokens at the default shape)."""
    return math.ceil(shape.tenants * math.ceil(shape.system / block_tokens) / 4) + 88


def words_bytes_per_token(shape: Shape) -> float:
    """The tenants' prompt bytes per token (a word), as an operator would configure it."""
    return round((len(make_words("t10", shape.system)) + 1) / shape.system, 2)


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
    systems = [make_words(f"t{t}", shape.system) for t in range(shape.tenants)]
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
            system = make_words(f"u{seed}r{i}", shape.system)
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
