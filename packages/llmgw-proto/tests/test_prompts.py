"""llmgw_proto.prompts: a model's tokenizer folder, chats rendered and prompts encoded as
vLLM does, shared by llmgw-router and llmgw-sim; importable without its extra."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from llmgw_proto.prompts import PromptEncoder, TokenizerError, token_list
from llmgw_testkit.tokenizer import turn_ids as ids
from llmgw_testkit.tokenizer import write_turn_tokenizer as write_tokenizer


def test_a_chat_is_rendered_by_the_template_and_encoded_without_adding_specials(
    tmp_path: Path,
) -> None:
    enc = PromptEncoder(write_tokenizer(tmp_path / "t"))
    assert enc.has_chat_template
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    assert enc.chat(messages) == ids("<bos> <turn> user hello <end> <turn> model")
    # An image part, or anything not a list of messages: not known here.
    assert enc.chat([{"role": "user", "content": [{"type": "image_url"}]}]) is None
    assert enc.chat("hello") is None


def test_a_completion_gets_the_tokenizers_specials_and_token_lists_stay(tmp_path: Path) -> None:
    enc = PromptEncoder(write_tokenizer(tmp_path / "t", None))
    assert not enc.has_chat_template
    assert enc.chat([{"role": "user", "content": "hello"}]) is None
    assert enc.completion("hello there") == ids("<bos> hello there")
    assert enc.completion([3, 4]) == [3, 4]
    assert enc.completion([True]) is None
    assert enc.completion({"x": 1}) is None


def test_a_folder_that_cannot_be_used_is_named(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json in"):
        PromptEncoder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match="is not a tokenizers file"):
        PromptEncoder(tmp_path)
    folder = write_tokenizer(tmp_path / "t", "{% if %}")
    with pytest.raises(TokenizerError, match="does not compile"):
        PromptEncoder(folder)


@given(st.lists(st.integers(min_value=-5, max_value=(1 << 32) + 5) | st.booleans()))
def test_a_token_list_is_exactly_a_list_of_unsigned_32_bit_ids(prompt: list[int]) -> None:
    valid = all(not isinstance(t, bool) and 0 <= t < 1 << 32 for t in prompt)
    assert token_list(prompt) == (prompt if valid else None)


def test_the_module_imports_without_tokenizers_or_jinja2_and_says_what_to_install(
    tmp_path: Path,
) -> None:
    folder = write_tokenizer(tmp_path / "t")
    # A None entry in sys.modules makes an import of it fail, as if not installed.
    code = (
        "import sys\n"
        "sys.modules['tokenizers'] = None\n"
        "sys.modules['jinja2'] = None\n"
        "import llmgw_proto.v1, llmgw_proto.prompts as p\n"
        "try:\n"
        f"    p.PromptEncoder(__import__('pathlib').Path({str(folder)!r}))\n"
        "except p.TokenizerError as err:\n"
        "    print(err)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "jinja2" in out.stdout
    assert "llmgw-proto[precise]" in out.stdout
