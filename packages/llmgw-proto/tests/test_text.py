"""visible(): terminal control characters from agents printed as escapes (issue 24.6)."""

from __future__ import annotations

import unicodedata

from hypothesis import given
from hypothesis import strategies as st
from llmgw_proto.text import visible, visible_data

ATTACK = "\x1b]0;pwned\x07\x1b[2J"


def test_an_osc_title_and_a_screen_clear_print_as_text() -> None:
    assert visible(ATTACK) == "\\x1b]0;pwned\\x07\\x1b[2J"
    assert visible("zone=a\nb\tc\r") == "zone=a\\x0ab\\x09c\\x0d"
    # C1 controls (CSI is 0x9b) and DEL; bidirectional overrides (Trojan Source).
    assert visible("\x9b2J\x7f") == "\\x9b2J\\x7f"
    assert visible("abc\u202edef\u2066") == "abc\\u202edef\\u2066"


def test_ordinary_text_is_unchanged() -> None:
    for text in ["", "gpu-a", "zone=eu-west-1", "Qwen/Qwen3-8B", "é ü 日本 🙂", "a\\x1b"]:
        assert visible(text) == text


def test_visible_data_reaches_keys_and_nested_values() -> None:
    data = {"nodes": [{"labels": {ATTACK: ATTACK}, "n": 3, "ok": True, "none": None}]}
    assert visible_data(data) == {
        "nodes": [
            {
                "labels": {visible(ATTACK): visible(ATTACK)},
                "n": 3,
                "ok": True,
                "none": None,
            }
        ]
    }


@given(st.text())
def test_no_control_character_survives(text: str) -> None:
    out = visible(text)
    assert not any(unicodedata.category(ch) == "Cc" for ch in out)
    assert not any(ch in out for ch in "\u2028\u2029\u202e\u2066")


@given(st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cf", "Zl", "Zp"))))
def test_printable_text_is_left_alone(text: str) -> None:
    assert visible(text) == text


@given(st.text(), st.text())
def test_escaping_is_per_character_and_each_escape_is_printable_ascii(a: str, b: str) -> None:
    assert visible(a + b) == visible(a) + visible(b)
    for ch in a:
        out = visible(ch)
        assert out == ch or (out.startswith("\\") and out.isascii() and out.isprintable())
