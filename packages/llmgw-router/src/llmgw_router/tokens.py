"""A served model's prompts as the engine tokenizes them, for precise prefix matching.

With ``cache_aware.tokenizers`` naming a model's tokenizer folder (the Hugging Face files
the engine loads: ``tokenizer.json``, and ``tokenizer_config.json`` with its chat template
or a ``chat_template.jinja``), the router turns a request's prompt into the token ids the
engine will cache, and so into ``llmgw_proto.token_blocks`` hashes, the names the agents
give the blocks the engines report cached. It renders as vLLM's OpenAI server does:

- chat: the template rendered by Jinja2 as transformers renders it (``trim_blocks``,
  ``lstrip_blocks``, ``raise_exception``, ``tojson``, the tokenizer's special tokens,
  ``add_generation_prompt=True``), then encoded without adding special tokens (the
  template writes them). A message whose content is a list of text parts is those texts
  joined by newlines, as vLLM does for a template that takes strings; any other part
  (an image) makes the prompt unknown here;
- completion: a string prompt encoded with the tokenizer's special tokens (its BOS), a
  list of token ids as given.

Anything it cannot render (a template error, a field it does not know) gives None: the
router then matches that request approximately, on its own prompt bytes, as without a
tokenizer. Needs the ``precise`` extra (``tokenizers`` and ``jinja2``). The folder's
loading, the rendering and the plain encoding are :mod:`llmgw_proto.prompts`' (shared with
llmgw-sim's ``--tokenizer``); this module adds the cache and the block hashes.

Each prompt prefix is tokenized once (:class:`TokenCache`). A rendered chat is cut into
segments just before each *boundary token*: an added token of the tokenizer (``<|im_start|>``,
``<start_of_turn>``) at which its encoding provably splits, so that the tokens of the whole
text are the tokens of its segments, each encoded alone, one after the other. Why: the
tokenizer first splits the text at its added tokens (leftmost-longest, on the raw text for
those not ``normalized``) and then normalizes, pre-tokenizes and encodes each piece on its
own. A position where such a token ``t`` begins is a split of every text, whatever comes
before it, when no added token has a proper suffix that is a prefix of ``t`` or begins with
``t`` (no match can straddle the position, so one begins there), ``t`` takes no whitespace
from before it (``lstrip``) and needs no word boundary (``single_word``), nor does a longer
added token beginning with ``t``; ``t`` neither begins nor ends with whitespace (nothing
strips across it); and when some added token is ``single_word``, ``t`` does not begin with a
word character (that token's test looks at it). The segment after the position begins with
an added token, so no piece of it starts the text: a pre-tokenizer that treats the text's
first piece differently (``Metaspace`` with ``prepend_scheme="first"``) does the same to it
alone as within the whole. A tokenizer with truncation, padding or
``encode_special_tokens`` gets no boundaries (whole texts are cached, nothing is cut).
Only the tokens the chat template writes (and the tokenizer's named specials) are cut at.
Segments are kept in a trie keyed by (parent segment, text), so a conversation's next turn
finds its earlier turns' tokens and encodes only what is new.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any, TypeAlias

from llmgw_proto.prompts import PromptEncoder, TokenizerError, token_list
from llmgw_proto.token_blocks import block_hash, token_block_hashes
from llmgw_proto.token_blocks import root as token_root

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "OFF_LOOP_CHARS",
    "PromptBlocks",
    "PromptTokenizer",
    "TokenCache",
    "TokenizerError",
    "Tokens",
    "boundary_pattern",
    "boundary_tokens",
    "cut_segments",
]

# cache_aware.token_cache_bytes' default: a few hundred long conversations.
DEFAULT_CACHE_BYTES = 64 * 1024 * 1024
# Text still to encode, in characters, from which the encoding runs on a worker thread
# rather than the event loop (``tokenizers`` releases the GIL): about 4,000 tokens, a few
# milliseconds, against the tens of microseconds a thread hop costs.
OFF_LOOP_CHARS = 16 * 1024
# A prompt's token ids (unsigned 32-bit, as token_blocks hashes them).
Tokens: TypeAlias = "array[int]"

# What one cached segment costs besides its text and its tokens (key, entry, dict slot).
_ENTRY_OVERHEAD = 200
# What one block size's hashes cost in an entry besides their 8 bytes each.
_HASHES_OVERHEAD = 150


def boundary_tokens(tokenizer: Any, among: AbstractSet[str] | None = None) -> list[str]:
    """The added tokens of ``tokenizer`` (a ``tokenizers.Tokenizer``) that its encoding
    splits at in every text (see the module's doc): a text cut just before one encodes
    as its two parts encoded alone, one after the other. Only those in ``among`` when
    given (every added token is still checked against). Linear in the added tokens'
    total length (a model may have thousands)."""
    if (
        tokenizer.truncation is not None
        or tokenizer.padding is not None
        or getattr(tokenizer, "encode_special_tokens", False)
    ):
        return []
    added = [a for a in tokenizer.get_added_tokens_decoder().values() if a.content]
    contents = [a.content for a in added]
    # Every proper suffix of an added token: none may be a prefix of t (that token would
    # straddle the cut)...
    suffixes = {c[i:] for c in contents for i in range(1, len(c))}
    # ...nor begin with t: t occurs inside an added token, not at its start.
    joined = "\x00".join(contents)
    starts = set(itertools.accumulate((len(c) + 1 for c in contents[:-1]), initial=0))
    # Prefixes of the tokens that take whitespace from before them or need a word
    # boundary: t must be none (a longer token beginning with t would match at the cut).
    risky = {
        a.content[:k]
        for a in added
        if not a.normalized and (a.lstrip or a.single_word)
        for k in range(1, len(a.content) + 1)
    }
    any_single_word = any(a.single_word for a in added)
    out = set()
    for a in added:
        t = a.content
        if among is not None and t not in among:
            continue
        if a.normalized or a.lstrip or a.single_word or t[0].isspace() or t[-1].isspace():
            continue
        if any_single_word and (t[0].isalnum() or t[0] == "_"):
            continue
        if t in risky or any(t[:k] in suffixes for k in range(1, len(t) + 1)):
            continue
        if _occurs_inside(joined, starts, t):
            continue
        out.add(t)
    return sorted(out)


def _occurs_inside(joined: str, starts: AbstractSet[int], t: str) -> bool:
    """Whether ``t`` occurs in ``joined`` (the tokens, separated) other than at one of
    the tokens' ``starts`` (an occurrence across a separator counts too: a false alarm,
    never a miss)."""
    at = joined.find(t)
    while at != -1:
        if at not in starts:
            return True
        at = joined.find(t, at + 1)
    return False


def boundary_pattern(tokens: Sequence[str]) -> re.Pattern[str] | None:
    """What finds the boundary ``tokens`` in a text (None: there are none)."""
    if not tokens:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


def cut_segments(text: str, pattern: re.Pattern[str] | None) -> list[str]:
    """``text`` cut just before each boundary token ``pattern`` finds."""
    if pattern is None:
        return [text]
    cuts = [m.start() for m in pattern.finditer(text) if m.start() > 0]
    if not cuts:
        return [text]
    return [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]


class _Entry:
    __slots__ = ("hashes", "key", "node", "size", "tokens")

    def __init__(self, key: tuple[int, str], node: int, tokens: array[int], size: int) -> None:
        self.key = key
        self.node = node
        self.tokens = tokens
        self.size = size
        # Per block size, the token_blocks hashes of the prompt's blocks that end within
        # this segment (see PromptBlocks): a prefix's blocks are hashed once.
        self.hashes: dict[int, array[int]] | None = None


# One prompt's way through the cache: per segment, its entry (None: not kept) and the
# prompt's token count at its end.
Path_: TypeAlias = "list[tuple[_Entry | None, int]]"


class TokenCache:
    """Token ids of prompt segments, one LRU bounded by bytes for all of a router's
    tokenizers: a trie of segments keyed by (parent node, segment text), each tokenizer
    from a root node of its own. ``on_use(cached, encoded)`` hears, per prompt, how many
    of its tokens came from here and how many were encoded."""

    def __init__(self, max_bytes: int, on_use: Callable[[int, int], None] | None = None) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.on_use = on_use
        self._entries: OrderedDict[tuple[int, str], _Entry] = OrderedDict()
        self._nodes = itertools.count(1)

    def __len__(self) -> int:
        return len(self._entries)

    def root(self) -> int:
        """A fresh root node (one per tokenizer, and per way of encoding)."""
        return next(self._nodes)

    def walk(self, parent: int, segments: Sequence[str]) -> tuple[list[array[int]], int]:
        """The cached tokens of the leading ``segments`` under ``parent`` (up to the first
        not cached) and the last one's node (``parent`` when none is)."""
        found, parent = self._walk(parent, segments)
        return [e.tokens for e in found], parent

    def _walk(self, parent: int, segments: Sequence[str]) -> tuple[list[_Entry], int]:
        found: list[_Entry] = []
        keys = []
        entries = self._entries
        for segment in segments:
            key = (parent, segment)
            entry = entries.get(key)
            if entry is None:
                break
            keys.append(key)
            found.append(entry)
            parent = entry.node
        # Most recent last, the root's side after the leaves': eviction takes a
        # conversation's tail before the head its other branches share.
        for key in reversed(keys):
            entries.move_to_end(key)
        return found, parent

    def put(self, parent: int, segment: str, ids: array[int]) -> int:
        """Caches ``segment``'s tokens under ``parent`` (kept as given); its node."""
        entry = self._put(parent, segment, ids)
        return self.root() if entry is None else entry.node

    def _put(self, parent: int, segment: str, ids: array[int]) -> _Entry | None:
        key = (parent, segment)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            return entry
        size = sys.getsizeof(segment) + ids.itemsize * len(ids) + _ENTRY_OVERHEAD
        if size > self.max_bytes:
            # Too big to keep: nothing finds it again.
            return None
        entry = self._entries[key] = _Entry(key, self.root(), ids, size)
        self.bytes += size
        self._evict()
        return entry

    def _evict(self) -> None:
        while self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.size

    def keep_hashes(self, entry: _Entry, block_size: int, hashes: array[int]) -> None:
        """Keeps ``hashes`` (of the blocks ending within ``entry``'s segment) with it,
        counted in its bytes; nothing when it was evicted meanwhile."""
        if self._entries.get(entry.key) is not entry:
            return
        if entry.hashes is None:
            entry.hashes = {}
        if block_size in entry.hashes:
            return
        entry.hashes[block_size] = hashes
        extra = hashes.itemsize * len(hashes) + _HASHES_OVERHEAD
        entry.size += extra
        self.bytes += extra
        self._evict()


# Conversations a chat template is rendered with once, to see which added tokens it
# writes (a template that refuses one, e.g. for its order of roles, is tried with the next).
_PROBES: list[list[dict[str, str]]] = [
    [
        {"role": "system", "content": "a"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "c"},
        {"role": "user", "content": "d"},
    ],
    [
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "c"},
        {"role": "user", "content": "d"},
    ],
    [{"role": "user", "content": "b"}],
]


class PromptTokenizer:
    """One model's tokenizer and chat template, loaded once at startup."""

    def __init__(
        self,
        folder: Path,
        cache: TokenCache | None = None,
        *,
        off_loop_chars: int = OFF_LOOP_CHARS,
    ) -> None:
        self._prompts = PromptEncoder(folder)
        self._tokenizer = self._prompts.tokenizer
        template = self._prompts.template
        self._special = self._prompts.special

        self._cache = cache if cache is not None else TokenCache(DEFAULT_CACHE_BYTES)
        self._off_loop_chars = off_loop_chars
        self._chat_root = self._cache.root()
        self._completion_root = self._cache.root()
        # Cut only at the tokens the template writes (a model may have thousands of
        # added tokens; a marker a client writes is still one the tokenizer splits at):
        # those in its source, and those in its renderings of a few conversations (a
        # template may build a marker, e.g. "<|" + role + "|>").
        source = template if isinstance(template, str) else ""
        rendered = [text for probe in _PROBES if (text := self.render(probe)) is not None]
        written = {t for t in self._special.values() if t} | {
            t
            for t in self._added_contents()
            if t and (t in source or any(t in text for text in rendered))
        }
        self.boundaries = boundary_tokens(self._tokenizer, written)
        self._cut = boundary_pattern(self.boundaries)

    def _added_contents(self) -> list[str]:
        return [a.content for a in self._tokenizer.get_added_tokens_decoder().values()]

    def _encode_batch(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        return self._prompts.encode_batch(texts, add_special_tokens)

    def full(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """``text`` encoded whole, without the cache (what the cached path must equal)."""
        return self._encode_batch([text], add_special_tokens)[0]

    def segments(self, text: str) -> list[str]:
        """``text`` cut just before each boundary token (the pieces the cache keeps)."""
        return cut_segments(text, self._cut)

    def _tokens(
        self, root: int, segments: list[str], add_special_tokens: bool
    ) -> tuple[Tokens, Path_]:
        found, parent = self._cache._walk(root, segments)
        missing = segments[len(found) :]
        encoded = self._encode_batch(missing, add_special_tokens) if missing else []
        return self._join(found, parent, missing, encoded)

    async def _tokens_off_loop(
        self, root: int, segments: list[str], add_special_tokens: bool
    ) -> tuple[Tokens, Path_]:
        found, parent = self._cache._walk(root, segments)
        missing = segments[len(found) :]
        if sum(map(len, missing)) < self._off_loop_chars:
            encoded = self._encode_batch(missing, add_special_tokens) if missing else []
        else:
            # The cache is touched on the loop only; the thread encodes and nothing else.
            encoded = await asyncio.get_running_loop().run_in_executor(
                None, self._encode_batch, missing, add_special_tokens
            )
        return self._join(found, parent, missing, encoded)

    def _join(
        self,
        found: list[_Entry],
        parent: int,
        missing: list[str],
        encoded: list[list[int]],
    ) -> tuple[Tokens, Path_]:
        cache = self._cache
        # An array, never a list: copying the cached arrays is a memcpy, where a list
        # would make an int object of every token (most of this path's cost).
        out: Tokens = array("I")
        path: Path_ = []
        for held in found:
            out.extend(held.tokens)
            path.append((held, len(out)))
        cached = len(out)
        kept = True
        for segment, ids in zip(missing, encoded, strict=True):
            tokens = array("I", ids)
            out.extend(tokens)
            # Below a segment not kept, nothing is found again: keep none.
            entry = cache._put(parent, segment, tokens) if kept else None
            if entry is None:
                kept = False
            else:
                parent = entry.node
            path.append((entry, len(out)))
        if cache.on_use is not None:
            cache.on_use(cached, len(out) - cached)
        return out, path

    @property
    def has_chat_template(self) -> bool:
        return self._prompts.has_chat_template

    def chat(self, messages: object) -> Tokens | None:
        """The token ids vLLM's chat endpoint gives ``messages``; None when not known here."""
        text = self.render(messages)
        if text is None:
            return None
        return self._tokens(self._chat_root, self.segments(text), False)[0]

    async def chat_blocks(self, messages: object, max_blocks: int) -> PromptBlocks | None:
        """:meth:`chat_async`'s tokens (None: not known here, or none) with their block
        hashes, those of its cached prefix taken from the cache."""
        text = self.render(messages)
        if text is None:
            return None
        tokens, path = await self._tokens_off_loop(self._chat_root, self.segments(text), False)
        return PromptBlocks(tokens, max_blocks, path, self._cache) if tokens else None

    async def completion_blocks(self, prompt: object, max_blocks: int) -> PromptBlocks | None:
        """:meth:`completion_async`'s tokens (None: not known here, or none) with their
        block hashes, kept in the cache for the same prompt again."""
        if isinstance(prompt, str):
            tokens, path = await self._tokens_off_loop(self._completion_root, [prompt], True)
            return PromptBlocks(tokens, max_blocks, path, self._cache) if tokens else None
        ids = _token_list(prompt)
        return PromptBlocks(ids, max_blocks) if ids else None

    async def chat_async(self, messages: object) -> Tokens | None:
        """:meth:`chat`, with a long encoding on a worker thread (off the event loop)."""
        text = self.render(messages)
        if text is None:
            return None
        return (await self._tokens_off_loop(self._chat_root, self.segments(text), False))[0]

    def render(self, messages: object) -> str | None:
        """``messages`` rendered by the chat template as vLLM does; None when not known."""
        return self._prompts.render(messages)

    def completion(self, prompt: object) -> Tokens | None:
        """The token ids vLLM's completion endpoint gives ``prompt``; None when not known."""
        if isinstance(prompt, str):
            # With the tokenizer's specials (a BOS, perhaps an EOS) the text is not cut:
            # only the same prompt again is found.
            return self._tokens(self._completion_root, [prompt], True)[0]
        return _token_list(prompt)

    async def completion_async(self, prompt: object) -> Tokens | None:
        """:meth:`completion`, with a long encoding on a worker thread."""
        if isinstance(prompt, str):
            return (await self._tokens_off_loop(self._completion_root, [prompt], True))[0]
        return _token_list(prompt)


def _token_list(prompt: object) -> Tokens | None:
    ids = token_list(prompt)
    return None if ids is None else array("I", ids)


class PromptBlocks:
    """One request's prompt tokens and their token_blocks hashes, per block size, once.

    With the prompt's ``path`` through a :class:`TokenCache` (its segments' entries), the
    hashes of the blocks ending within a cached segment come from that entry, where an
    earlier prompt with the same prefix left them: a conversation's next turn hashes only
    its new blocks (the chain's hash of block ``i`` depends on blocks ``0..i`` alone, which
    a shared prefix fixes). The hashes are those of :func:`token_block_hashes` either way."""

    __slots__ = ("_by_size", "_cache", "_path", "max_blocks", "root", "tokens")

    def __init__(
        self,
        tokens: Sequence[int],
        max_blocks: int,
        path: Path_ | None = None,
        cache: TokenCache | None = None,
        root: int = 0,
    ) -> None:
        self.tokens = tokens
        self.max_blocks = max_blocks
        # The chain's start: token_blocks.root(adapter) for a LoRA adapter's request, whose
        # blocks an engine caches apart from the base model's (its events carry lora_name).
        self.root = root
        self._path = path if cache is not None and not root else None
        self._cache = cache
        self._by_size: dict[int, list[int]] = {}

    def under(self, adapter: str) -> PromptBlocks:
        """The same tokens as a request for LoRA ``adapter`` hashes them (the cache's
        hashes are the base model's, so none is reused)."""
        return PromptBlocks(self.tokens, self.max_blocks, root=token_root(adapter))

    def hashes(self, block_size: int) -> list[int]:
        out = self._by_size.get(block_size)
        if out is None:
            if self._path and self._cache is not None and block_size > 0:
                out = self._chained(block_size, self._path, self._cache)
            else:
                out = token_block_hashes(
                    self.tokens, block_size, parent=self.root, max_blocks=self.max_blocks
                )
            self._by_size[block_size] = out
        return out

    def _chained(self, size: int, path: Path_, cache: TokenCache) -> list[int]:
        tokens = self.tokens
        limit = self.max_blocks
        out: array[int] = array("Q")
        parent = 0
        for entry, end in path:
            if len(out) >= limit:
                break
            # The blocks ending within this segment: from len(out) to end // size.
            stop = end // size
            held = entry.hashes.get(size) if entry is not None and entry.hashes else None
            if held is not None:
                out.extend(held)
            else:
                first = len(out)
                for i in range(first, min(stop, limit)):
                    parent = block_hash(parent, tokens[i * size : (i + 1) * size])
                    out.append(parent)
                if entry is not None and stop <= limit:
                    cache.keep_hashes(entry, size, out[first:])
            if out:
                parent = out[-1]
        return out[:limit].tolist()

    def prefix(self, block_tokens: int) -> tuple[int, ...]:
        """The balancer's prefix blocks from the tokens rather than the request's bytes:
        the same for every client's JSON spacing and key order (a prompt shorter than a
        block is one partial block)."""
        full = self.hashes(block_tokens)
        if full:
            return tuple(full)
        return (block_hash(self.root, self.tokens),)

    def cached(self, blocks: AbstractSet[int] | None, block_size: int) -> int:
        """Leading blocks of the prompt in ``blocks`` (an engine's cache); -1 for no view."""
        if blocks is None or block_size <= 0:
            return -1
        count = 0
        for h in self.hashes(block_size):
            if h not in blocks:
                break
            count += 1
        return count
