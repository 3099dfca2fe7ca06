"""--sim-* flags and LLMGW_SIM_* variables."""

from __future__ import annotations

import pytest
from llmgw_sim.knobs import KnobError, knob_help, load_knobs, split_sim_args


def test_split_keeps_engine_flags_apart() -> None:
    engine, sim = split_sim_args(
        ["m", "--port", "1", "--sim-itl", "0.5", "--sim-ttft=0.1", "--sim-log-requests", "-tp", "2"]
    )
    assert engine == ["m", "--port", "1", "-tp", "2"]
    assert sim == [("--sim-itl", "0.5"), ("--sim-ttft", "0.1"), ("--sim-log-requests", None)]


def test_flag_beats_environment() -> None:
    knobs = load_knobs(
        [("--sim-itl", "0.25")], {"LLMGW_SIM_ITL": "9", "LLMGW_SIM_LOAD_TIME": "1.5"}
    )
    assert knobs.itl == 0.25
    assert knobs.load_time == 1.5
    assert knobs.log_requests is False


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        ([("--sim-itl", "fast")], {}, "--sim-itl: expected float"),
        ([("--sim-itl", "-1")], {}, "--sim-itl: must be >= 0"),
        ([("--sim-bogus", "1")], {}, "unknown simulator flag --sim-bogus"),
        ([("--sim-mode", "loud")], {}, "--sim-mode: expected one of random, echo"),
        ([], {"LLMGW_SIM_ERROR_RATE": "2"}, "LLMGW_SIM_ERROR_RATE: must be between 0 and 1"),
        ([("--sim-error-status", "200")], {}, "must be an HTTP error status"),
        ([("--sim-ttft", None)], {}, "--sim-ttft: expected a value"),
        ([("--sim-itl", "nan")], {}, "expected a finite number"),
        ([("--sim-error-types", "rate_limit,boom")], {}, "unknown failure type"),
        ([("--sim-time-factor-under-load", "0.5")], {}, "must be >= 1"),
    ],
)
def test_bad_knobs_are_named(
    args: list[tuple[str, str | None]], env: dict[str, str], message: str
) -> None:
    with pytest.raises(KnobError, match=message):
        load_knobs(args, env)


def test_every_knob_has_help() -> None:
    rows = knob_help()
    assert ("--sim-load-time", "LLMGW_SIM_LOAD_TIME") in {(f, e) for f, e, _ in rows}
    assert all(desc for _, _, desc in rows)
