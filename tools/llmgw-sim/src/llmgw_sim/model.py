"""The simulated engine's pure logic: tokens, prefix cache, batch slots, timing.

Nothing here does I/O or reads the clock, so all of it is unit-testable; the
server wires it to asyncio.
"""

from __future__ import annotations

import itertools
import random
import re
import zlib
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

# A crude tokenizer: words, single punctuation marks, and runs of whitespace
# glued to the following word.  It is deterministic and fast, which is all the
# timing model and the prefix cache need.
_TOKEN_RE = re.compile(r"\s*\w+|\s*[^\w\s]|\s+")


def tokenize(text: str, limit: int | None = None) -> list[str]:
    """The text's tokens; with ``limit``, at most that many (bounded work for huge prompts)."""
    if limit is None or len(text) <= limit:
        # Every token has at least one character: the text cannot exceed the limit.
        return _TOKEN_RE.findall(text)
    return [m.group() for m in itertools.islice(_TOKEN_RE.finditer(text), limit)]


# Prompts are tokenized only this far (or to --max-model-len + 1 when larger): enough to
# refuse anything too long, while a 64 MB body costs a fraction of a second, not seconds.
TOKEN_COUNT_CAP = 1 << 20


_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "been",
    "one",
    "all",
    "we",
    "their",
    "has",
    "would",
    "when",
    "if",
    "so",
    "no",
    "will",
    "can",
    "more",
    "its",
    "about",
    "out",
    "up",
    "into",
    "them",
    "only",
    "some",
    "could",
    "time",
    "these",
    "two",
    "may",
    "then",
    "do",
    "first",
    "any",
    "my",
    "now",
    "such",
    "like",
    "our",
    "over",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "get",
    "here",
    "between",
    "both",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
    "last",
    "might",
    "us",
    "great",
    "old",
    "year",
    "off",
    "come",
    "since",
    "against",
    "go",
    "came",
    "right",
    "used",
    "take",
    "three",
]


def _cycle() -> list[str]:
    n = len(_WORDS)
    # A step co-prime to len(_WORDS) visits every word before repeating, so the
    # text looks less like a loop than the word list itself would.
    step = 7 if n % 7 else 11
    return [" " + _WORDS[(i * step) % n] for i in range(n)]


_CYCLE = _cycle()


def greedy_tokens(context: str, count: int, seed: int = 0) -> list[str]:
    """``count`` word tokens that continue ``context`` as a greedy model would.

    Each token is a function of the whole text before it (the context and the tokens
    so far, as characters: a CRC-32 carried along, so it does not matter how the text
    is split into tokens) and of the seed. So continuing from ``context`` followed by
    the first k tokens gives exactly the rest: ``greedy_tokens(c + "".join(out[:k]),
    n - k) == out[k:]`` where ``out = greedy_tokens(c, n)``.
    """
    n = len(_CYCLE)
    state = zlib.crc32(context.encode("utf-8", "surrogatepass"), seed & 0xFFFFFFFF)
    out: list[str] = []
    for _ in range(count):
        # The CRC's high bits mix better than its low ones for a small modulus.
        token = _CYCLE[((state * 0x9E3779B1) >> 16) % n]
        out.append(token)
        state = zlib.crc32(token.encode(), state)
    return out


def generate_tokens(count: int, seed: int) -> list[str]:
    """``count`` word tokens, the same for the same seed."""
    n = len(_CYCLE)
    start = seed % n
    out = _CYCLE[start:] + _CYCLE * (count // n + 1)
    del out[count:]
    return out


class Vocabulary:
    """Token ids for the crude tokenizer: stable within a process, reversible for /detokenize."""

    def __init__(self, limit: int = 1 << 20) -> None:
        self._ids: dict[str, int] = {}
        self._strs: list[str] = []
        self._limit = limit

    def encode(self, tokens: Iterable[str]) -> list[int]:
        out: list[int] = []
        for tok in tokens:
            tid = self._ids.get(tok)
            if tid is None:
                if len(self._strs) >= self._limit:
                    tid = 0  # vocabulary full: unknown token
                else:
                    tid = len(self._strs)
                    self._ids[tok] = tid
                    self._strs.append(tok)
            out.append(tid)
        return out

    def decode(self, ids: Iterable[int]) -> str:
        strs = self._strs
        return "".join(strs[i] if 0 <= i < len(strs) else "" for i in ids)


def echo_tokens(prompt_tokens: Sequence[str], count: int) -> list[str]:
    """The prompt's own tokens, repeated to ``count`` tokens (echo mode)."""
    if not prompt_tokens:
        return generate_tokens(count, 0)
    reps = count // len(prompt_tokens) + 1
    return (list(prompt_tokens) * reps)[:count]


class PrefixCache:
    """A block-granular prefix cache with LRU eviction, like vLLM's.

    A prompt's full blocks are hashed in a chain (each block's hash covers all
    tokens before it), so a hit on block *i* means the whole prefix matched.
    Counters are in tokens, as vLLM's ``prefix_cache_queries``/``hits`` are.
    """

    def __init__(self, block_size: int, capacity_blocks: int, *, enabled: bool = True) -> None:
        if block_size <= 0 or capacity_blocks < 0:
            raise ValueError("block_size must be > 0 and capacity_blocks >= 0")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.enabled = enabled
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.queries = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def block_hashes(self, tokens: Sequence[Hashable]) -> list[int]:
        bs = self.block_size
        hashes: list[int] = []
        prev = 0
        for start in range(0, len(tokens) - bs + 1, bs):
            prev = hash((prev, *tokens[start : start + bs]))
            hashes.append(prev)
        return hashes

    def lookup(self, tokens: Sequence[Hashable]) -> tuple[int, list[int]]:
        """Return (cached prefix length in tokens, the prompt's block hashes)."""
        if not self.enabled:
            return 0, []
        hashes = self.block_hashes(tokens)
        # The last prompt token is always computed (its logits give the first
        # output token), so a fully cached prompt still leaves one token to do.
        usable = (len(tokens) - 1) // self.block_size if tokens else 0
        hit_blocks = 0
        for h in hashes[:usable]:
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            hit_blocks += 1
        hit_tokens = hit_blocks * self.block_size
        self.queries += len(tokens)
        self.hits += hit_tokens
        return hit_tokens, hashes

    def insert(self, hashes: Iterable[int]) -> None:
        if not self.enabled:
            return
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)


class BatchSlots:
    """At most ``max_running`` sequences run at once; the rest wait, first come first served."""

    def __init__(self, max_running: int) -> None:
        if max_running <= 0:
            raise ValueError("max_running must be > 0")
        self.max_running = max_running
        self._running: set[int] = set()
        self._waiting: deque[int] = deque()
        self._waiting_set: set[int] = set()

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting_set)

    def is_running(self, rid: int) -> bool:
        return rid in self._running

    def submit(self, rid: int) -> bool:
        """Add a request; True when it runs at once, False when it has to wait."""
        if rid in self._running or rid in self._waiting_set:
            raise ValueError(f"request {rid} submitted twice")
        if len(self._running) < self.max_running and not self._waiting_set:
            self._running.add(rid)
            return True
        self._waiting.append(rid)
        self._waiting_set.add(rid)
        return False

    def release(self, rid: int) -> list[int]:
        """Remove a request (finished, failed or abandoned); return those that start now."""
        if rid in self._waiting_set:
            self._waiting_set.discard(rid)
            # Left in the deque and skipped when popped: O(1) cancellation.
            return []
        if rid not in self._running:
            return []
        self._running.discard(rid)
        started: list[int] = []
        while self._waiting and len(self._running) < self.max_running:
            nxt = self._waiting.popleft()
            if nxt in self._waiting_set:
                self._waiting_set.discard(nxt)
                self._running.add(nxt)
                started.append(nxt)
        return started


@dataclass(frozen=True)
class Timing:
    """Token pace: time to first token grows with the prompt part not in the cache.

    Optional jitter (a normal draw, kept within 30%..170% of the mean, as
    llm-d-inference-sim bounds it) and a slow-down under load: with
    ``load_factor`` f, times stretch linearly from x1 with one running sequence
    to xf with every batch slot busy.
    """

    ttft: float = 0.0
    itl: float = 0.0
    prefill_per_token: float = 0.0
    ttft_std: float = 0.0
    itl_std: float = 0.0
    load_factor: float = 1.0

    def time_to_first_token(self, prompt_tokens: int, cached_tokens: int) -> float:
        return self.ttft + self.prefill_per_token * max(0, prompt_tokens - cached_tokens)

    def decode_time(self, output_tokens: int) -> float:
        return self.itl * max(0, output_tokens - 1)

    def load_scale(self, running: int, max_running: int) -> float:
        if self.load_factor == 1.0:
            return 1.0
        if max_running <= 1:
            return self.load_factor  # the one slot is all slots
        busy = min(1.0, max(0, running - 1) / (max_running - 1))
        return 1.0 + (self.load_factor - 1.0) * busy

    @staticmethod
    def jitter(mean: float, std: float, rng: random.Random) -> float:
        if std <= 0 or mean <= 0:
            return mean
        return min(1.7 * mean, max(0.3 * mean, rng.gauss(mean, std)))


def output_length(
    *,
    requested_max: int | None,
    sim_output_len: int | None,
    default_max_tokens: int,
    prompt_tokens: int,
    max_model_len: int,
    ignore_eos: bool = False,
) -> tuple[int, str]:
    """How many tokens to generate and the finish reason ("length" or "stop")."""
    room = max(0, max_model_len - prompt_tokens)
    cap = room if requested_max is None else min(requested_max, room)
    if ignore_eos:
        want = cap  # no end-of-sequence: run to the limit
    elif sim_output_len is not None:
        want = sim_output_len
    elif requested_max is not None:
        want = requested_max
    else:
        want = default_max_tokens
    count = min(want, cap)
    # Running into the request's max_tokens or the context's end reads as
    # "length", exactly as a real engine reports a generation cut short.
    return count, ("length" if count >= cap else "stop")
