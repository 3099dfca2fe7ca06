"""Precise prefix matching: prompts tokenized as the engine does, matched against the
blocks the engines report cached (named by llmgw_proto.token_blocks)."""

from __future__ import annotations

from pathlib import Path

import pytest
from llmgw_proto.config import ConfigError, load
from llmgw_proto.token_blocks import root, token_block_hashes
from llmgw_proto.v1 import EndpointCache
from llmgw_router.config import RouterConfig, validate
from llmgw_router.control.watch import apply_cache
from llmgw_router.endpoints import Endpoint, EndpointSpec
from llmgw_router.tokens import PromptBlocks, PromptTokenizer
from llmgw_testkit.tokenizer import turn_ids as ids
from llmgw_testkit.tokenizer import write_turn_tokenizer as write_tokenizer


def test_chat_is_rendered_by_the_template_and_encoded_without_adding_specials(
    tmp_path: Path,
) -> None:
    tok = PromptTokenizer(write_tokenizer(tmp_path / "t"))
    messages = [{"role": "user", "content": "hello there"}]
    # The template writes the BOS itself; the tokenizer adds none on top.
    assert list(tok.chat(messages) or []) == ids("<bos> <turn> user hello there <end> <turn> model")
    # Text parts are joined by newlines (whitespace to this tokenizer), as vLLM does.
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}],
        }
    ]
    assert tok.chat(parts) == tok.chat(messages)
    # An image part, or something that is not a list of messages: not known here.
    assert tok.chat([{"role": "user", "content": [{"type": "image_url"}]}]) is None
    assert tok.chat("hello") is None
    assert tok.chat([1, 2]) is None


def test_completion_adds_the_tokenizers_specials_and_takes_token_lists_as_given(
    tmp_path: Path,
) -> None:
    tok = PromptTokenizer(write_tokenizer(tmp_path / "t"))
    assert list(tok.completion("a b c") or []) == ids("<bos> a b c")
    assert list(tok.completion([5, 6, 7]) or []) == [5, 6, 7]
    assert tok.completion(["a", "b"]) is None
    assert tok.completion([True]) is None


def test_a_template_error_makes_the_prompt_unknown_and_no_template_means_no_chat(
    tmp_path: Path,
) -> None:
    raising = "{{ raise_exception('no system role') }}"
    tok = PromptTokenizer(write_tokenizer(tmp_path / "r", raising))
    assert tok.chat([{"role": "user", "content": "a"}]) is None
    plain = PromptTokenizer(write_tokenizer(tmp_path / "p", None))
    assert not plain.has_chat_template
    assert plain.chat([{"role": "user", "content": "a"}]) is None
    assert list(plain.completion("a") or []) == ids("<bos> a")


def test_prompt_blocks_count_the_leading_blocks_an_engine_holds() -> None:
    tokens = list(range(40))
    blocks = PromptBlocks(tokens, max_blocks=256)
    hashes = token_block_hashes(tokens, 8)
    assert blocks.hashes(8) == hashes  # 5 full blocks
    assert blocks.cached(None, 8) == -1
    assert blocks.cached(set(), 8) == 0
    assert blocks.cached(set(hashes[:3]), 8) == 3
    # A hole ends the match: the engine would prefill from there.
    assert blocks.cached({hashes[0], hashes[2]}, 8) == 1
    assert PromptBlocks(tokens, max_blocks=2).cached(set(hashes), 8) == 2


def _config(tmp_path: Path, body: str) -> RouterConfig:
    path = tmp_path / "router.yaml"
    path.write_text(body)
    return validate(load(path, RouterConfig), str(path))


def test_the_config_names_a_tokenizer_folder_that_is_missing_or_unusable(tmp_path: Path) -> None:
    good = write_tokenizer(tmp_path / "good")
    cfg = _config(tmp_path, f"cache_aware:\n  tokenizers:\n    m: {good}\n")
    assert cfg.cache_aware.tokenizers == {"m": str(good)}
    with pytest.raises(ConfigError) as missing:
        _config(tmp_path, f"cache_aware:\n  tokenizers:\n    m: {tmp_path / 'nope'}\n")
    assert "$.cache_aware.tokenizers['m']" in str(missing.value)
    assert "no such directory" in str(missing.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError) as unusable:
        _config(tmp_path, f"cache_aware:\n  tokenizers:\n    m: {empty}\n")
    assert "no tokenizer.json in" in str(unusable.value)
    (empty / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError) as broken:
        _config(tmp_path, f"cache_aware:\n  tokenizers:\n    m: {empty}\n")
    assert "is not a tokenizers file" in str(broken.value)


def _endpoint(ident: str) -> Endpoint:
    return Endpoint(EndpointSpec(id=ident, url=f"http://{ident}", models=("m",)))


def _blocks(ep: Endpoint) -> set[int] | None:
    return ep.token_blocks  # read anew each time (mypy would narrow the attribute)


def test_an_endpoints_token_blocks_follow_its_engines_cache_events() -> None:
    ep = _endpoint("e")
    # Engine hashes (no token ids): counted, not matched.
    apply_cache(ep, EndpointCache(endpoint_id="e", stored=[1, 2], cleared=True, block_size=16))
    assert ep.cached_blocks == 2
    assert _blocks(ep) is None
    # A new engine: the agent's first word is an empty clear, then its blocks by token ids.
    apply_cache(ep, EndpointCache(endpoint_id="e", cleared=True))
    assert _blocks(ep) == set()
    apply_cache(
        ep, EndpointCache(endpoint_id="e", stored=[5, 6, 7], block_size=16, token_hashes=True)
    )
    assert _blocks(ep) == {5, 6, 7}
    assert ep.token_block_size == 16
    apply_cache(
        ep,
        EndpointCache(endpoint_id="e", stored=[8], removed=[5], block_size=16, token_hashes=True),
    )
    assert _blocks(ep) == {6, 7, 8}
    assert ep.cached_blocks == 3
    # A restarted engine (its generation) forgets everything.
    apply_cache(
        ep,
        EndpointCache(endpoint_id="e", stored=[9], block_size=16, token_hashes=True, generation=7),
    )
    assert _blocks(ep) == {9}
    assert ep.cached_blocks == 1


def test_with_a_tokenizer_the_prefix_is_the_same_for_any_json_spacing(tmp_path: Path) -> None:
    """Clients serialise one conversation differently (spacing, key order); the router's
    byte blocks differ, its token blocks do not."""
    tok = PromptTokenizer(write_tokenizer(tmp_path / "t"))
    compact = [{"role": "user", "content": "hello there " * 20}]
    reordered = [{"content": "hello there " * 20, "role": "user"}]
    a = PromptBlocks(tok.chat(compact) or [], max_blocks=256)
    b = PromptBlocks(tok.chat(reordered) or [], max_blocks=256)
    assert a.prefix(8) == b.prefix(8)
    assert len(a.prefix(8)) == len(a.tokens) // 8
    # Shorter than a block: one partial block, still a prefix to place by.
    short = PromptBlocks([1, 2, 3], max_blocks=256)
    assert len(short.prefix(8)) == 1
    assert short.prefix(8) != PromptBlocks([1, 2, 4], max_blocks=256).prefix(8)


def test_an_adapters_blocks_chain_from_its_root_as_the_agent_names_its_engines_blocks() -> None:
    """An engine caches an adapter's prompt apart from the base model's and its events say
    which (lora_name); the agent chains those blocks from root(lora_name). The router's
    blocks of an adapter's request chain from the same root: the same prompt matches only
    what was cached under the same adapter."""
    tokens = list(range(40))
    base = PromptBlocks(tokens, max_blocks=256)
    a = base.under("gemma3-a")
    assert a.tokens is base.tokens
    assert a.hashes(8) == token_block_hashes(tokens, 8, parent=root("gemma3-a"))
    assert not set(a.hashes(8)) & set(base.hashes(8))
    assert not set(a.hashes(8)) & set(base.under("gemma3-b").hashes(8))
    assert a.cached(set(a.hashes(8)[:3]), 8) == 3
    assert a.cached(set(base.hashes(8)), 8) == 0
    # The balancer's prefix too, a prompt shorter than a block included.
    assert a.prefix(8) != base.prefix(8)
    short = PromptBlocks([1, 2, 3], max_blocks=256)
    assert short.under("gemma3-a").prefix(8) != short.prefix(8)
