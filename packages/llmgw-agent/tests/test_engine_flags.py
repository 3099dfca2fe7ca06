"""engine_flags: engines' own help texts parsed into the options they accept."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st
from llmgw_agent.engine_flags import (
    captured,
    captured_text,
    captured_versions,
    normalize_kind,
    parse_help,
)


def test_captured_versions_are_listed() -> None:
    assert "0.32.0" in captured_versions("vllm")
    assert "b11434" in captured_versions("llama-server")
    with pytest.raises(LookupError, match="captured are"):
        captured("vllm", "0.1.0")
    with pytest.raises(ValueError, match="expected one of vllm, sglang, llamacpp"):
        normalize_kind("tgi")


def test_vllm_0_32_options() -> None:
    spec = captured("vllm", "0.32.0")
    assert spec.version == "0.32.0"
    assert len(spec.options) > 300
    for flag in ("--max-model-len", "-tp", "--kv-events-config", "--enforce-eager", "--headless"):
        assert spec.accepts(flag), flag
    # Flags vLLM 0.30+ removed are refused.
    for gone in ("--disable-log-requests", "--enable-reasoning", "--swap-space", "--task"):
        assert not spec.accepts(gone), gone
    assert spec.takes_value("--max-model-len")
    assert not spec.takes_value("--enforce-eager")
    assert spec.accepts("--no-enforce-eager")
    # vLLM's own spellings: underscores, dotted JSON keys, -O3.
    assert spec.accepts("--max_model_len")
    assert spec.accepts("--compilation-config.mode")
    parsed = spec.parse(["-O3", "--served-model-name", "a", "b", "--dtype", "half", "-tp4"])
    assert parsed.errors == []
    assert parsed.values == {
        "--optimization-level": ["3"],
        "--served-model-name": ["a", "b"],
        "--dtype": ["half"],
        "--tensor-parallel-size": ["4"],
    }
    assert spec.parse(["--dtype", "bf16"]).errors == [
        "engine argument '--dtype': 'bf16' is not one of "
        "auto, bfloat16, float, float16, float32, half"
    ]
    assert spec.parse(["--help"]).errors == ["engine argument '--help' prints something and exits"]


def test_llama_server_layout() -> None:
    spec = captured("llamacpp", "b11434")
    fa = spec.option("-fa")
    assert fa is not None
    assert (fa.min_values, fa.max_values) == (0, 1)
    assert spec.option("--control-vector-layer-range").max_values == 2  # type: ignore[union-attr]
    assert spec.option("--docker-repo").min_values == 1  # type: ignore[union-attr]
    assert spec.option("-nkvo") is spec.option("--kv-offload")
    assert spec.accepts("--cpu-moe")
    assert not spec.accepts("--mlock")
    parsed = spec.parse(["-c", "4096", "-fa", "--metrics", "--seed", "-1"])
    assert parsed.errors == []
    assert parsed.values == {
        "--ctx-size": ["4096"],
        "--flash-attn": [],
        "--metrics": [],
        "--seed": ["-1"],
    }


def _argparse_help(options: list[tuple[str, str]]) -> str:
    parser = argparse.ArgumentParser(prog="engine")
    for name, kind in options:
        if kind == "switch":
            parser.add_argument(name, action="store_true")
        elif kind == "bool":
            parser.add_argument(name, action=argparse.BooleanOptionalAction)
        elif kind == "many":
            parser.add_argument(name, nargs="+")
        elif kind == "any":
            parser.add_argument(name, nargs="*")
        elif kind == "optional":
            parser.add_argument(name, nargs="?")
        elif kind == "choice":
            parser.add_argument(name, choices=["a", "b"])
        else:
            parser.add_argument(name)
    return parser.format_help()


_KINDS = st.sampled_from(["switch", "bool", "many", "any", "optional", "choice", "value"])
_NAMES = st.from_regex(r"--[a-z][a-z0-9]{0,6}(-[a-z0-9]{1,6}){0,3}", fullmatch=True)


@given(st.dictionaries(_NAMES, _KINDS, min_size=1, max_size=12))
def test_any_argparse_help_is_read_as_argparse_reads_it(options: dict[str, str]) -> None:
    """Whatever argparse prints, the parser finds every option with the arity argparse uses."""
    names = [n for n in options if not n.startswith("--no-") and n != "--help"]
    if not names:
        return
    chosen = {n: options[n] for n in names}
    text = _argparse_help(list(chosen.items()))
    spec = parse_help("sglang", text)
    for name, kind in chosen.items():
        option = spec.option(name)
        assert option is not None, name
        expected = {
            "switch": (0, 0),
            "bool": (0, 0),
            "many": (1, None),
            "any": (0, None),
            "optional": (0, 1),
            "choice": (1, 1),
            "value": (1, 1),
        }[kind]
        assert (option.min_values, option.max_values) == expected, (name, kind, text)
        if kind == "bool":
            assert spec.option("--no-" + name[2:]) is option
        if kind == "choice":
            assert option.choices == ("a", "b")


@given(
    st.lists(st.sampled_from(["--max-model-len", "8", "--enforce-eager", "x", "-tp"]), max_size=8)
)
def test_parse_never_raises_and_names_each_problem(args: list[str]) -> None:
    parsed = captured("vllm").parse(args)
    assert all(isinstance(e, str) and e for e in parsed.errors)
    assert set(parsed.values) <= {"--max-model-len", "--enforce-eager", "--tensor-parallel-size"}


def test_captured_text_is_the_file() -> None:
    version, text = captured_text("llama-server")
    assert version == captured_versions("llamacpp")[-1]
    assert "--ctx-size" in text
