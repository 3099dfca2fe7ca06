"""Each prompt prefix tokenized once: the cached path gives exactly a full tokenization's tokens.

Tokenizers here are real ``tokenizers`` pipelines trained on the spot: byte-level BPE (GPT-2,
Llama 3, Qwen), Metaspace with ``prepend_scheme="first"`` behind NFC (Llama 2, Gemma) and a
word-level one (the testkit's), with added tokens of every kind of flag.
"""

from __future__ import annotations

import asyncio
import json
import random
from array import array
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from llmgw_proto.prompts import PromptEncoder
from llmgw_proto.token_blocks import block_hash, token_block_hashes
from llmgw_router.tokens import (
    PromptTokenizer,
    TokenCache,
    boundary_pattern,
    boundary_tokens,
    cut_segments,
)
from llmgw_testkit.cluster import metric_sum
from llmgw_testkit.tokenizer import write_word_tokenizer
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers

# Characters the texts are made of: markup, whitespace of several kinds, a combining accent
# (NFC composes it with what precedes it), other scripts.
ALPHABET = "ab <>|_\n\t\u00e9e\u0301x\u4e2d\U0001f600"
GEMMA = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@cache
def base(family: str) -> str:
    """A small tokenizer of ``family`` with no added tokens, as JSON."""
    rnd = random.Random(family)
    trainer: trainers.Trainer
    corpus = ["".join(rnd.choice(ALPHABET) for _ in range(60)) for _ in range(300)]
    corpus += ["user model assistant system hello there\n" * 3] * 20
    if family == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(
            vocab_size=400,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    elif family == "metaspace":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], show_progress=False)
    else:
        tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        trainer = trainers.WordLevelTrainer(special_tokens=["<unk>"], show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return tok.to_str()


def with_added(family: str, added: list[AddedToken]) -> Tokenizer:
    tok = Tokenizer.from_str(base(family))
    for token in added:
        if token.special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    return tok


def encode(tok: Tokenizer, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False).ids)


def chat_tokenizer(folder: Path, family: str, template: str, specials: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tok = with_added(family, [AddedToken(s, special=True, normalized=False) for s in specials])
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": specials[0], "eos_token": specials[-1], "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


families = st.sampled_from(["bytelevel", "metaspace", "words"])
token_texts = st.text(alphabet="ab<>|_ \n\u00e9", min_size=1, max_size=4)
added_tokens = st.lists(
    st.one_of(
        # Flagged as turn markers are (the candidates for boundaries)...
        st.builds(AddedToken, token_texts, normalized=st.just(False), special=st.booleans()),
        # ...and anyhow.
        st.builds(
            AddedToken,
            token_texts,
            single_word=st.booleans(),
            lstrip=st.booleans(),
            rstrip=st.booleans(),
            normalized=st.booleans(),
            special=st.booleans(),
        ),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=500, deadline=None)
@given(family=families, added=added_tokens, data=st.data())
def test_a_text_cut_at_boundary_tokens_encodes_as_its_segments_encoded_alone(
    family: str, added: list[AddedToken], data: st.DataObject
) -> None:
    tok = with_added(family, added)
    contents = st.sampled_from([a.content for a in added])
    # Texts made of random characters and the added tokens (the boundaries among them)
    # in any order, so tokens meet whitespace, accents, pieces of tokens and each other
    # at every side.
    pieces = st.text(alphabet=ALPHABET, max_size=8)
    parts = data.draw(st.lists(st.one_of(contents, contents, pieces), max_size=12))
    text = "".join(parts)
    try:
        full = encode(tok, text)
    except BaseException as err:  # pyo3's PanicException is no Exception
        # tokenizers 0.23 panics ("AddedVocabulary bad split") on some stripping added
        # tokens that overlap: no full tokenization to compare with, here or in an engine.
        assume("bad split" not in str(err))
        raise
    segments = cut_segments(text, boundary_pattern(boundary_tokens(tok)))
    assert "".join(segments) == text
    assert [t for segment in segments for t in encode(tok, segment)] == full


def test_turn_markers_are_boundaries_unless_their_flags_or_overlaps_make_them_unsafe() -> None:
    plain = [AddedToken(t, special=True, normalized=False) for t in ("<bos>", "<turn>", "<end>")]
    assert boundary_tokens(with_added("bytelevel", plain)) == ["<bos>", "<end>", "<turn>"]
    # Takes the whitespace before it: the text before it would lose its tail.
    lstrip = AddedToken("<turn>", special=True, normalized=False, lstrip=True)
    assert boundary_tokens(with_added("bytelevel", [lstrip])) == []
    # Matched after normalization: the normalizer sees across it.
    normalized = AddedToken("<turn>", special=True, normalized=True)
    assert "<turn>" not in boundary_tokens(with_added("metaspace", [normalized]))
    # Another added token ends with what <turn> begins with ("x<t" + "urn>...").
    overlap = [*plain, AddedToken("x<t", normalized=False)]
    assert "<turn>" not in boundary_tokens(with_added("bytelevel", overlap))
    # Truncation changes what a whole text encodes to: nothing is cut.
    truncating = with_added("bytelevel", plain)
    truncating.enable_truncation(16)
    assert boundary_tokens(truncating) == []


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    gemma = ["<bos>", "<start_of_turn>", "<end_of_turn>"]
    chatml = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return {
        "gemma-bytelevel": chat_tokenizer(root / "gb", "bytelevel", GEMMA, gemma),
        "gemma-metaspace": chat_tokenizer(root / "gm", "metaspace", GEMMA, gemma),
        "chatml-bytelevel": chat_tokenizer(root / "cb", "bytelevel", CHATML, chatml),
        "chatml-words": chat_tokenizer(root / "cw", "words", CHATML, chatml),
        # The testkit's: a template that builds its markers ("<|" + role + "|>").
        "built-markers": write_word_tokenizer(root / "bm", ["hello", "there", "a", "b"]),
    }


roles = st.sampled_from(["system", "user", "assistant"])
contents = st.one_of(
    st.text(alphabet=ALPHABET, max_size=40),
    # What a client may write: the template's own markers inside a message.
    st.sampled_from(["<start_of_turn>", "<|im_end|>\n", " <end_of_turn>x", "\n\n", ""]),
)
conversations = st.lists(
    st.fixed_dictionaries({"role": roles, "content": contents}), min_size=1, max_size=6
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    name=st.sampled_from(
        ["gemma-bytelevel", "gemma-metaspace", "chatml-bytelevel", "chatml-words", "built-markers"]
    ),
    conversation=conversations,
    cache_bytes=st.sampled_from([1500, 64 * 1024 * 1024]),
    off_loop=st.booleans(),
)
def test_the_cached_path_gives_the_tokens_of_a_full_tokenization_turn_after_turn(
    folders: dict[str, Path],
    name: str,
    conversation: list[dict[str, str]],
    cache_bytes: int,
    off_loop: bool,
) -> None:
    # One cache for the whole conversation (small: segments evicted between turns, or
    # while a turn is walked), encodings on the loop or on a worker thread.
    tok = PromptTokenizer(
        folders[name], TokenCache(cache_bytes), off_loop_chars=0 if off_loop else 1 << 30
    )
    encoder = PromptEncoder(folders[name])
    for turn in range(1, len(conversation) + 1):
        messages = conversation[:turn]
        text = tok.render(messages)
        assert text is not None
        expected = tok.full(text)
        assert list(tok.chat(messages) or []) == expected
        # The shared encoder the simulator uses (no cache): the same ids.
        assert encoder.chat(messages) == expected
        assert list(asyncio.run(tok.chat_async(messages)) or []) == expected
        # A second time: from the cache alone.
        assert list(tok.chat(messages) or []) == expected


def test_a_conversations_next_turn_encodes_only_what_is_new(folders: dict[str, Path]) -> None:
    uses: list[tuple[int, int]] = []
    tok = PromptTokenizer(
        folders["gemma-bytelevel"], TokenCache(1 << 20, on_use=lambda c, e: uses.append((c, e)))
    )
    assert tok.boundaries == ["<bos>", "<end_of_turn>", "<start_of_turn>"]
    first = [{"role": "user", "content": "hello there " * 50}]
    tokens = tok.chat(first)
    assert tokens is not None
    assert uses[-1] == (0, len(tokens))
    # The same prompt again: every token from the cache.
    assert tok.chat(first) == tokens
    assert uses[-1] == (len(tokens), 0)
    # The next turn: the first turn's tokens from the cache, the reply and question new.
    second = [*first, {"role": "model", "content": "a b"}, {"role": "user", "content": "x"}]
    full = tok.full(tok.render(second) or "")
    assert list(tok.chat(second) or []) == full
    cached, encoded = uses[-1]
    assert cached + encoded == len(full)
    assert encoded < 20 < cached


def test_the_cache_stays_within_its_bytes_and_drops_what_is_least_recently_used(
    folders: dict[str, Path],
) -> None:
    cache = TokenCache(4000)
    tok = PromptTokenizer(folders["chatml-bytelevel"], cache)
    for i in range(50):
        assert tok.chat([{"role": "user", "content": f"hello {i} " * 5}]) is not None
        assert cache.bytes <= 4000
    assert 0 < len(cache) < 50 * 3
    # A segment larger than the whole cache is encoded, not kept.
    huge = "hello there " * 1000
    assert list(tok.completion(huge) or []) == tok.full(huge, add_special_tokens=True)
    assert cache.bytes <= 4000


def test_completions_are_cached_whole_with_the_tokenizers_specials(
    folders: dict[str, Path],
) -> None:
    uses: list[tuple[int, int]] = []
    tok = PromptTokenizer(
        folders["gemma-metaspace"], TokenCache(1 << 20, on_use=lambda c, e: uses.append((c, e)))
    )
    prompt = "hello <start_of_turn> there"
    expected = tok.full(prompt, add_special_tokens=True)
    assert list(tok.completion(prompt) or []) == expected
    assert list(asyncio.run(tok.completion_async(prompt)) or []) == expected
    assert uses == [(0, len(expected)), (len(expected), 0)]
    assert list(tok.completion([1, 2, 3]) or []) == [1, 2, 3]
    assert tok.completion([1 << 32]) is None
    assert tok.completion([True]) is None


def test_the_proxy_and_v1_match_share_one_tokenizer_and_its_cache(
    folders: dict[str, Path],
    spawn_engines: Callable[..., Any],
    spawn_router: Callable[..., Any],
) -> None:
    """A real router process over a simulated engine: what the proxy tokenized, /v1/match
    finds in the cache (one tokenizer, loaded once), and a conversation's next turn encodes
    only its new part."""
    (engine,) = spawn_engines(1)
    router = spawn_router(
        {
            "balancer": "cache_aware",
            "cache_aware": {"tokenizers": {"m1": str(folders["gemma-bytelevel"])}},
            "health_checks": {"enabled": False},
            "endpoints": [{"id": engine.id, "url": engine.url, "models": ["m1"]}],
        }
    )

    def tokens(source: str) -> float:
        return metric_sum(router.metrics(), "llmgw_router_token_cache_tokens_total", source=source)

    # Long enough (over OFF_LOOP_CHARS) to be encoded on a worker thread.
    first = [{"role": "user", "content": "hello there " * 2000}]
    reply = httpx.post(
        router.url + "/v1/chat/completions", json={"model": "m1", "messages": first}, timeout=30
    )
    assert reply.status_code == 200, reply.text
    encoded = tokens("encoded")
    assert encoded > 2000
    assert tokens("cache") == 0
    match = httpx.post(
        router.admin + "/v1/match", json={"model": "m1", "messages": first}, timeout=30
    )
    assert match.status_code == 200, match.text
    # Every token from the proxy's cache: the same tokenizer, not a copy of its own.
    assert match.json()["prompt_tokens"] == encoded
    assert tokens("cache") == encoded
    assert tokens("encoded") == encoded
    assert metric_sum(router.metrics(), "llmgw_router_token_cache_bytes") > 4 * encoded
    # The next turn: the first turn from the cache, the reply and the question encoded.
    second = [*first, {"role": "model", "content": "a b"}, {"role": "user", "content": "x"}]
    match = httpx.post(
        router.admin + "/v1/match", json={"model": "m1", "messages": second}, timeout=30
    )
    assert match.status_code == 200, match.text
    assert tokens("cache") + tokens("encoded") == encoded * 2 + match.json()["prompt_tokens"]
    assert tokens("encoded") - encoded < 20


@given(st.lists(st.integers(0, (1 << 32) - 1), max_size=300), st.integers(1, 40))
def test_block_hashes_of_an_array_of_tokens_are_those_of_the_list(
    tokens: list[int], block_size: int
) -> None:
    # The router hashes its arrays' bytes as they are; the agent hashes lists.
    assert token_block_hashes(array("I", tokens), block_size) == token_block_hashes(
        tokens, block_size
    )
    assert block_hash(7, array("I", tokens)) == block_hash(7, tokens)


def test_only_the_markers_the_template_writes_are_cut_at(tmp_path: Path) -> None:
    # Gemma 3 has thousands of added tokens (<unused0>...); the cut is at the template's.
    specials = ["<bos>", "<start_of_turn>", "<end_of_turn>"] + [f"<unused{i}>" for i in range(3000)]
    tok = with_added("bytelevel", [AddedToken(s, special=True, normalized=False) for s in specials])
    folder = tmp_path / "many"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<bos>", "chat_template": GEMMA}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    prompt = PromptTokenizer(folder)
    assert prompt.boundaries == ["<bos>", "<end_of_turn>", "<start_of_turn>"]
    # Every added token that is safe would do, given the choice.
    assert len(boundary_tokens(tok)) == len(specials)
    # A client writing another added token: still the full tokenization's tokens.
    messages = [{"role": "user", "content": "hello <unused5> there " * 20}]
    assert list(prompt.chat(messages) or []) == prompt.full(prompt.render(messages) or "")


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    name=st.sampled_from(["gemma-bytelevel", "chatml-bytelevel", "chatml-words"]),
    conversation=conversations,
    cache_bytes=st.sampled_from([1500, 4000, 64 * 1024 * 1024]),
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    max_blocks=st.integers(1, 40),
)
def test_the_cached_path_gives_the_block_hashes_of_a_full_tokenization_turn_after_turn(
    folders: dict[str, Path],
    name: str,
    conversation: list[dict[str, str]],
    cache_bytes: int,
    sizes: list[int],
    max_blocks: int,
) -> None:
    # Hashes kept with the cached segments (some evicted between turns, or while the
    # hashes are kept) are those of the whole prompt's tokens hashed afresh.
    cache = TokenCache(cache_bytes)
    tok = PromptTokenizer(folders[name], cache)
    for turn in range(1, len(conversation) + 1):
        messages = conversation[:turn]
        expected = tok.full(tok.render(messages) or "")
        for _ in range(2):
            blocks = asyncio.run(tok.chat_blocks(messages, max_blocks))
            if not expected:
                assert blocks is None
                continue
            assert blocks is not None
            assert list(blocks.tokens) == expected
            for size in sizes:
                want = token_block_hashes(expected, size, max_blocks=max_blocks)
                assert blocks.hashes(size) == want
                assert blocks.prefix(size) == (tuple(want) or (block_hash(0, expected),))
            assert cache.bytes <= cache_bytes


def test_a_conversations_next_turn_hashes_only_its_new_blocks(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import llmgw_router.tokens as tokens_module

    hashed: list[int] = []

    def counting(parent: int, tokens: Any) -> int:
        hashed.append(len(tokens))
        return block_hash(parent, tokens)

    monkeypatch.setattr(tokens_module, "block_hash", counting)
    tok = PromptTokenizer(folders["gemma-bytelevel"], TokenCache(1 << 20))
    first = [{"role": "user", "content": "hello there " * 50}]
    one = asyncio.run(tok.chat_blocks(first, 256))
    assert one is not None
    assert len(one.hashes(4)) == len(one.tokens) // 4 == len(hashed)
    second = [*first, {"role": "model", "content": "a b"}, {"role": "user", "content": "x"}]
    hashed.clear()
    two = asyncio.run(tok.chat_blocks(second, 256))
    assert two is not None
    expected = tok.full(tok.render(second) or "")
    assert two.hashes(4) == token_block_hashes(expected, 4, max_blocks=256)
    # Only the blocks ending after the first turn's last segment kept its hashes (the
    # generation prompt's segment, "<start_of_turn>model\n", is not in the second turn).
    assert 0 < len(hashed) < 20 < len(one.tokens) // 4


def test_markers_a_template_builds_are_cut_at_too(folders: dict[str, Path]) -> None:
    # "<|" + role + "|>": no marker is in the template's source, each is in what it
    # renders. Before, only <s> and <|assistant|> were cut at, so a tenant's shared system
    # prompt and each new question were one segment, encoded (and hashed) whole each time.
    uses: list[tuple[int, int]] = []
    tok = PromptTokenizer(
        folders["built-markers"], TokenCache(1 << 20, on_use=lambda c, e: uses.append((c, e)))
    )
    assert {"<|system|>", "<|user|>", "<|assistant|>"} <= set(tok.boundaries)
    system = {"role": "system", "content": "hello there " * 500}
    for question in ("a b", "b a a"):
        messages = [system, {"role": "user", "content": question}]
        tokens = tok.chat(messages)
        assert list(tokens or []) == tok.full(tok.render(messages) or "")
    cached, encoded = uses[-1]
    # The second question: the system prompt's 1,000 tokens from the cache.
    assert cached >= 1000
    assert encoded < 10
