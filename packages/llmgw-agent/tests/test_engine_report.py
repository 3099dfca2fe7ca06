"""The flags an engine accepts, as Register carries them (EngineInfo.value_flags /
switch_flags / flags_listed) for `llmgw-control check --admin` (issue 29 point 9)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from llmgw_agent.engine_flags import FlagSpec, Option, captured
from llmgw_agent.engines import FLAG_CHARS_MAX, FLAGS_MAX, InstalledEngine, reported_flags


def test_captured_engines_report_their_whole_help() -> None:
    for kind in ("vllm", "sglang", "llamacpp"):
        spec = captured(kind)
        info = InstalledEngine(kind, "/bin/x", spec.version, spec).info()
        assert info.flags_listed
        assert set(info.value_flags) | set(info.switch_flags) == set(spec.spellings())
        assert not set(info.value_flags) & set(info.switch_flags)
        assert len(info.value_flags) + len(info.switch_flags) <= FLAGS_MAX
    info = InstalledEngine("vllm", "/bin/x", "0.32.0", captured("vllm", "0.32.0")).info()
    assert "--max-model-len" in info.value_flags
    assert "-tp" in info.value_flags
    assert "--enforce-eager" in info.switch_flags
    assert "--help" not in info.switch_flags  # prints and exits: never a profile's


def test_an_engine_without_help_lists_nothing() -> None:
    info = InstalledEngine("vllm", "/bin/x", error="no help").info()
    assert not info.flags_listed
    assert not info.value_flags
    assert not info.switch_flags


_NAME = st.text(alphabet="abcdefghij-", min_size=1, max_size=FLAG_CHARS_MAX + 10).map(
    lambda s: "--" + s
)


@given(st.lists(st.tuples(_NAME, st.booleans()), max_size=40))
def test_within_bounds_or_nothing(options: list[tuple[str, bool]]) -> None:
    spec = FlagSpec(
        "vllm", "1", tuple(Option((name,), int(v), int(v)) for name, v in dict(options).items())
    )
    value, switch = reported_flags(spec)
    names = spec.spellings()
    if any(len(n) > FLAG_CHARS_MAX for n in names):
        assert (value, switch) == ([], [])
    else:
        assert set(value) | set(switch) == set(names)
        assert all(spec.takes_value(n) for n in value)
        assert not any(spec.takes_value(n) for n in switch)
