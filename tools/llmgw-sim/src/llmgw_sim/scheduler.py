"""A vLLM-style engine step loop: pure, no I/O and no clock.

One :meth:`Scheduler.schedule` call plans one forward pass ("step"): running
sequences first (their decode token, or the next chunk of a chunked prefill), then
waiting ones first come first served, all sharing one token budget
(``--max-num-batched-tokens``) and at most ``--max-num-seqs`` running sequences.
The KV cache is a fixed number of blocks of ``block_size`` tokens. A prompt's full
blocks are named by a hash chain over its tokens (block *i*'s hash covers every token
before it), so a hit on block *i* means the whole prefix up to it matched. Blocks a
running sequence holds are referenced and never evicted; a finished sequence's full
blocks stay cached, unreferenced, and are evicted least recently used first when a
new block is needed (its tail blocks first, as vLLM frees them). A sequence that
cannot get a block for its next token preempts the most recently admitted running
sequence (which is recomputed later, as vLLM's recompute preemption does).

:meth:`Scheduler.finish_step` applies the planned step and says what each sequence
produced; :class:`StepCosts` says how long the step took. The server drives both
against the real clock.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepCosts:
    """The duration of one forward pass.

    ``step_s`` is the fixed cost of any pass (reading the weights: the inter-token
    latency of a lone sequence), ``decode_seq_s`` the extra per decoding sequence
    (its KV reads and sampling), and prefill runs at ``prefill_tokens_per_s``.
    """

    prefill_tokens_per_s: float = 20_000.0
    step_s: float = 0.008
    decode_seq_s: float = 0.0001

    def step_time(self, prefill_tokens: int, decodes: int) -> float:
        if prefill_tokens == 0 and decodes == 0:
            return 0.0
        prefill = prefill_tokens / self.prefill_tokens_per_s if self.prefill_tokens_per_s else 0.0
        return self.step_s + prefill + decodes * self.decode_seq_s


def block_hashes(tokens: Sequence[str], block_size: int) -> list[int]:
    """Hash chain over the prompt's full blocks (stable across processes: blake2b)."""
    out: list[int] = []
    prev = b"\0" * 8
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hashlib.blake2b(prev, digest_size=8)
        h.update("\x1f".join(tokens[start : start + block_size]).encode())
        prev = h.digest()
        # A signed 64-bit value, as vLLM's KV events carry block hashes.
        out.append(int.from_bytes(prev, "big", signed=True))
    return out


class _Block:
    __slots__ = ("hash", "ref")

    def __init__(self) -> None:
        self.hash: int | None = None
        self.ref = 1


class KVCache:
    """``num_blocks`` blocks; referenced ones pinned, unreferenced cached ones LRU-evicted."""

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free = num_blocks  # blocks holding nothing
        self._cached: dict[int, _Block] = {}  # every block with a hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # hashes with ref 0, LRU first
        # Block hashes stored and removed since the last drain (KV events), and the
        # hash of the block before each stored one in its prompt (None for a first block).
        self.stored: list[int] = []
        self.removed: list[int] = []
        self.parents: dict[int, int | None] = {}
        self.tokens: dict[int, Sequence[int]] = {}

    # ----- accounting --------------------------------------------------------

    @property
    def referenced(self) -> int:
        """Blocks some running sequence holds."""
        return self.num_blocks - self._free - len(self._evictable)

    @property
    def cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """vLLM's kv_cache_usage_perc: referenced blocks over all (cached free ones count free)."""
        return self.referenced / self.num_blocks

    @property
    def available(self) -> int:
        """Blocks a new allocation could get (free, or evictable)."""
        return self._free + len(self._evictable)

    def is_cached(self, h: int) -> bool:
        return h in self._cached

    # ----- operations --------------------------------------------------------

    def match(self, hashes: Sequence[int], limit: int) -> int:
        """How many of the first ``limit`` blocks are cached (no side effects)."""
        if not self.prefix_caching:
            return 0
        n = 0
        for h in hashes[:limit]:
            if h not in self._cached:
                break
            n += 1
        return n

    def acquire(self, hashes: Iterable[int]) -> list[_Block]:
        """Reference cached blocks (a prefix hit); they leave the eviction order."""
        out: list[_Block] = []
        for h in hashes:
            block = self._cached[h]
            if block.ref == 0:
                del self._evictable[h]
            block.ref += 1
            out.append(block)
        return out

    def new_block(self) -> _Block | None:
        """A fresh block: a free one, else the least recently used unreferenced cached one."""
        if self._free:
            self._free -= 1
            return _Block()
        if self._evictable:
            h, _ = self._evictable.popitem(last=False)
            del self._cached[h]
            self.removed.append(h)
            return _Block()
        return None

    def register(
        self,
        block: _Block,
        h: int,
        parent: int | None = None,
        tokens: Sequence[int] | None = None,
    ) -> None:
        """A full block's tokens are computed: cache it under its hash (unless cached already)."""
        if not self.prefix_caching or block.hash is not None or h in self._cached:
            return
        block.hash = h
        self._cached[h] = block
        self.stored.append(h)
        self.parents[h] = parent
        if tokens is not None:
            self.tokens[h] = tokens

    def release(self, blocks: Sequence[_Block]) -> None:
        """Drop a sequence's references; tail blocks become the first to be evicted."""
        for block in reversed(blocks):
            block.ref -= 1
            if block.ref > 0:
                continue
            if block.hash is None:
                self._free += 1
            else:
                self._evictable[block.hash] = None

    def drain_events(self) -> tuple[list[int], list[int]]:
        stored, removed = self.stored, self.removed
        self.stored, self.removed = [], []
        self.parents = {h: self.parents[h] for h in self.stored}
        self.tokens = {h: self.tokens[h] for h in self.stored if h in self.tokens}
        return stored, removed

    def drain_blocks(
        self,
    ) -> tuple[list[tuple[int, int | None, Sequence[int]]], list[int]]:
        """(stored block hash, its parent's and its token ids (empty when not a real
        tokenizer's), removed hashes) since the last drain."""
        parents, tokens = self.parents, self.tokens
        stored, removed = self.drain_events()
        self.parents, self.tokens = {}, {}
        return [(h, parents.get(h), tokens.get(h, ())) for h in stored], removed


@dataclass
class Seq:
    """One request in the engine."""

    rid: int
    prompt_len: int
    max_output: int
    hashes: list[int]
    computed: int = 0  # tokens whose KV is in the cache
    generated: int = 0  # output tokens sampled so far
    target: int = 0  # tokens to prefill before the next sample (prompt, or more after preemption)
    blocks: list[_Block] = field(default_factory=list)
    admitted: bool = False
    cached_tokens: int = 0  # prefix hit at its first admission
    preemptions: int = 0
    # The prompt's token ids when they are a real tokenizer's (--tokenizer): the KV
    # events carry each stored block's, as vLLM's do.
    token_ids: Sequence[int] | None = None
    # The LoRA adapter it runs with (None: the base model).
    lora: str | None = None
    # Its prompt's KV cache came from a prefill engine (llmgw_sim.kvtransfer): on its first
    # admission only the last prompt token is computed here (prefill work is charged to
    # the prefill engine alone); the blocks are still this engine's to hold.
    remote_kv: bool = False

    def __post_init__(self) -> None:
        self.target = self.prompt_len

    @property
    def prefilling(self) -> bool:
        return self.computed < self.target


@dataclass(frozen=True)
class Planned:
    seq: Seq
    tokens: int


@dataclass(frozen=True)
class StepPlan:
    items: tuple[Planned, ...]
    prefill_tokens: int
    decodes: int
    preempted: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.items


@dataclass(frozen=True)
class StepEvent:
    """What one sequence got from a step: ``new_tokens`` sampled (0 or 1), and whether it
    is done (``finished``) and this was its first token (``first``)."""

    rid: int
    new_tokens: int
    first: bool
    finished: bool


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    num_blocks: int
    block_size: int
    prefix_caching: bool = True
    # Distinct LoRA adapters in one batch at most (vLLM --max-loras, SGLang
    # --max-loras-per-batch); 0: no LoRA limit.
    max_loras: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        if config.max_num_seqs <= 0 or config.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be > 0")
        self.config = config
        self.cache = KVCache(
            config.num_blocks, config.block_size, prefix_caching=config.prefix_caching
        )
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self._by_id: dict[int, Seq] = {}
        # Counters in tokens, as vLLM's prefix_cache_queries/hits are.
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.preemptions = 0
        self.prompt_tokens_computed = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def fits(self, prompt_len: int, max_output: int) -> bool:
        """Could this request ever run (its whole sequence in the cache at once)?"""
        bs = self.config.block_size
        return -(-(prompt_len + max_output) // bs) <= self.config.num_blocks

    def add(self, seq: Seq) -> None:
        if seq.rid in self._by_id:
            raise ValueError(f"request {seq.rid} added twice")
        self._by_id[seq.rid] = seq
        self.waiting.append(seq)

    def abort(self, rid: int) -> None:
        """Remove a request (client gone) and release its blocks."""
        seq = self._by_id.pop(rid, None)
        if seq is None:
            return
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.cache.release(seq.blocks)
        seq.blocks = []

    # ----- planning ----------------------------------------------------------

    def _grow(self, seq: Seq, tokens: int) -> bool:
        """Give ``seq`` blocks for ``tokens`` tokens in all; False when the cache is full."""
        need = -(-tokens // self.config.block_size) - len(seq.blocks)
        if need <= 0:
            return True
        if need > self.cache.available:
            return False
        for _ in range(need):
            block = self.cache.new_block()
            assert block is not None
            seq.blocks.append(block)
        return True

    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        self.cache.release(seq.blocks)
        seq.blocks = []
        # Recompute: prompt and what was generated so far are prefilled again.
        seq.target = seq.prompt_len + seq.generated
        seq.computed = 0
        seq.admitted = False
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _admit_prefix(self, seq: Seq) -> None:
        """On (re)admission, start from the cached prefix of the prompt."""
        bs = self.config.block_size
        # The last prompt token is always computed: its logits give the next token.
        limit = (seq.target - 1) // bs
        hit = self.cache.match(seq.hashes, limit)
        seq.blocks = self.cache.acquire(seq.hashes[:hit])
        seq.computed = hit * bs

    def schedule(self) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        items: list[Planned] = []
        preempted: list[int] = []
        prefill = decodes = 0
        # 1. Running sequences, oldest first.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            want = min(seq.target - seq.computed, budget) if seq.prefilling else 1
            while not self._grow(seq, seq.computed + want):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.rid)
                if victim is seq:
                    break
            if seq not in self.running:
                break  # it preempted itself: nothing older is left to take blocks from
            items.append(Planned(seq, want))
            budget -= want
            if seq.prefilling:
                prefill += want
            else:
                decodes += 1
            i += 1
        # 2. Waiting sequences, first come first served, while slots and budget last; one
        # whose adapter would exceed the batch's LoRA slots waits, and the next may go (as
        # vLLM's scheduler skips it).
        limit = self.config.max_loras
        active = {s.lora for s in self.running if s.lora is not None}
        skipped: list[Seq] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if limit and seq.lora is not None and seq.lora not in active and len(active) >= limit:
                skipped.append(self.waiting.popleft())
                continue
            if not self.fits(seq.target, 1):
                break  # never fits; the server refuses such requests before they get here
            self._admit_prefix(seq)
            hit = seq.computed
            if seq.remote_kv and seq.preemptions == 0:
                seq.computed = max(seq.computed, seq.target - 1)
            want = min(seq.target - seq.computed, budget)
            if not self._grow(seq, seq.computed + want):
                # No room now: hand back the prefix blocks and wait for a later step.
                self.cache.release(seq.blocks)
                seq.blocks = []
                seq.computed = 0
                break
            self.waiting.popleft()
            if seq.preemptions == 0:
                seq.cached_tokens = hit
                self.prefix_queries += seq.prompt_len
                self.prefix_hits += hit
            seq.admitted = True
            self.running.append(seq)
            if seq.lora is not None:
                active.add(seq.lora)
            items.append(Planned(seq, want))
            budget -= want
            prefill += want
        self.waiting.extendleft(reversed(skipped))
        return StepPlan(tuple(items), prefill, decodes, tuple(preempted))

    # ----- applying ----------------------------------------------------------

    def finish_step(self, plan: StepPlan) -> list[StepEvent]:
        events: list[StepEvent] = []
        bs = self.config.block_size
        for item in plan.items:
            seq = item.seq
            if seq.rid not in self._by_id or seq not in self.running:
                continue  # aborted or preempted meanwhile
            was_prefill = seq.prefilling
            before = seq.computed
            seq.computed += item.tokens
            if was_prefill:
                self.prompt_tokens_computed += item.tokens
            # Full prompt blocks computed in this step join the prefix cache.
            full = min(seq.computed, seq.prompt_len) // bs
            for b in range(before // bs, min(full, len(seq.hashes))):
                parent = seq.hashes[b - 1] if b else None
                ids = seq.token_ids
                self.cache.register(
                    seq.blocks[b],
                    seq.hashes[b],
                    parent,
                    ids[b * bs : (b + 1) * bs] if ids is not None else None,
                )
            if seq.prefilling:
                continue  # more prompt chunks to go: nothing sampled yet
            first = seq.generated == 0
            new = 1 if seq.generated < seq.max_output else 0
            seq.generated += new
            finished = seq.generated >= seq.max_output
            if finished:
                self.running.remove(seq)
                del self._by_id[seq.rid]
                self.cache.release(seq.blocks)
                seq.blocks = []
            events.append(StepEvent(seq.rid, new, first and new > 0, finished))
        return events
