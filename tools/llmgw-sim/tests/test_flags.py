"""Engine flags come from the captured help of named engine versions (issues 12.2, 16.3)."""

from __future__ import annotations

import argparse
from importlib import resources
from pathlib import Path

import httpx
import pytest
from llmgw_agent.engine_flags import parse_help
from llmgw_sim.flags import (
    EngineKind,
    human_readable_int,
    known_flags,
    parse_engine_args,
    resolve_version,
    spec,
)
from llmgw_sim.testing import SIM, run_to_exit, start

HELP_FILES = {
    "vllm": ("vllm", "vllm-0.32.0.txt", "0.32.0"),
    "sglang": ("sglang", "sglang-0.5.23.txt", "0.5.23"),
    "llama-server": ("llamacpp", "llama-server-b11434.txt", "b11434"),
}


@pytest.mark.parametrize("kind", ["vllm", "sglang", "llama-server"])
def test_accepts_exactly_the_options_of_the_captured_help(kind: EngineKind, tmp_path: Path) -> None:
    agent_kind, name, version = HELP_FILES[kind]
    text = (resources.files("llmgw_agent") / "engine_help" / name).read_text(encoding="utf-8")
    from_help = parse_help(agent_kind, text).spellings()
    assert known_flags(kind, version) == from_help
    flags = spec(kind, version)
    # Every spelling the help lists parses, with a value where it takes one.
    for flag in sorted(from_help):
        option = flags.option(flag)
        assert option is not None
        value = option.choices[0] if option.choices else "1"
        if kind == "sglang" and flag == "--config":
            # SGLang reads the options file it names (a YAML mapping).
            value = str(tmp_path / "options.yaml")
            (tmp_path / "options.yaml").write_text("{}\n")
        args = [flag, *[value] * max(option.min_values, 1 if option.takes_value else 0)]
        if kind == "sglang" and flag not in ("--model-path", "--model"):
            args += ["--model-path", "m"]
        parse_engine_args(kind, args, version)


@pytest.mark.parametrize(
    "flag",
    # Removed from vLLM by 0.30+, which the old hand-kept table still accepted.
    ["--disable-log-requests", "--enable-reasoning", "--swap-space", "--task", "--rope-theta"],
)
def test_vllm_refuses_flags_its_help_no_longer_lists(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert flag not in known_flags("vllm")
    with pytest.raises(SystemExit) as exc:
        parse_engine_args("vllm", ["m", flag, "1"] if flag != "--enable-reasoning" else ["m", flag])
    assert exc.value.code == 2
    assert f"vllm serve: error: unrecognized arguments: {flag}" in capsys.readouterr().err


def test_llama_server_takes_every_b11434_flag_the_old_table_refused() -> None:
    ns = parse_engine_args("llama-server", ["-m", "/m.gguf", "--cpu-moe", "-c", "8192"])
    assert ns.non_default_args["cpu_moe"] is True
    assert ns.ctx_size == 8192


def test_sim_version_picks_a_captured_version() -> None:
    assert resolve_version("vllm", None) == "0.32.0"
    assert resolve_version("vllm", "0.32") == "0.32.0"
    assert resolve_version("llama-server", "11434") == "b11434"
    assert resolve_version("sglang", None) == "0.5.23"
    with pytest.raises(ValueError, match=r"knows 0\.32\.0"):
        resolve_version("vllm", "0.11")


def test_sim_version_on_the_command_line(tmp_path: Path) -> None:
    bad = run_to_exit(tmp_path / "bad", [*SIM, "vllm", "serve", "m", "--sim-version", "0.99"])
    assert bad.returncode == 2
    assert "llmgw-sim: error: --sim-version: no captured vllm help for version '0.99'" in (
        bad.output
    )
    with start(tmp_path / "ok", "vllm", ["--sim-version", "0.32"]) as sim:
        assert httpx.get(sim.url + "/version").json() == {"version": "0.32.0"}
        assert "vLLM API server version 0.32.0" in sim.proc.output()


def test_help_prints_the_engines_own_text(tmp_path: Path) -> None:
    out = run_to_exit(tmp_path, [*SIM, "vllm", "serve", "--help=all"])
    assert out.returncode == 0
    assert "usage: vllm serve [model_tag] [options]" in out.output
    assert "--max-num-batched-tokens" in out.output


def test_known_flags_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown engine kind"):
        known_flags("tgi")  # type: ignore[arg-type]


def test_vllm_defaults_match_vllm() -> None:
    ns = parse_engine_args("vllm", ["org/model"])
    assert ns.model_tag == "org/model"
    assert ns.port == 8000
    assert ns.host is None
    assert ns.tensor_parallel_size == 1
    assert ns.gpu_memory_utilization == 0.9
    assert ns.enable_prefix_caching is None
    assert ns.master_port == 29501
    assert ns.headless is False


def test_vllm_types_aliases_and_underscores() -> None:
    ns = parse_engine_args(
        "vllm",
        [
            "m", "-tp", "4", "--pipeline_parallel_size=2", "--max-model-len", "32k",
            "--no-enable-prefix-caching", "--served-model-name", "a", "b", "--api-key", "k1",
            "--gpu-memory-utilization", "0.5", "--headless", "--nnodes", "2", "--node-rank", "1",
            "--enforce-eager",
        ],
    )  # fmt: skip
    assert ns.tensor_parallel_size == 4
    assert ns.pipeline_parallel_size == 2
    assert ns.max_model_len == 32000
    assert ns.enable_prefix_caching is False
    assert ns.served_model_name == ["a", "b"]
    assert ns.api_key == ["k1"]
    assert ns.gpu_memory_utilization == 0.5
    assert (ns.headless, ns.nnodes, ns.node_rank) == (True, 2, 1)
    assert ns.non_default_args["enforce_eager"] is True
    assert ns.non_default_args["tensor_parallel_size"] == 4


def test_unknown_vllm_flag_exits_2_with_argparse_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_engine_args("vllm", ["m", "--not-a-flag", "1"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --not-a-flag 1" in capsys.readouterr().err


def test_bad_type_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_engine_args("vllm", ["m", "--tensor-parallel-size", "two"])
    assert exc.value.code == 2
    assert "argument --tensor-parallel-size: invalid int value: 'two'" in capsys.readouterr().err


def test_missing_value_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_engine_args("vllm", ["m", "--port"])
    assert exc.value.code == 2
    assert "argument --port: expected one argument" in capsys.readouterr().err


def test_sglang_requires_model_path(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_engine_args("sglang", ["--port", "1"])
    assert exc.value.code == 2
    assert "--model-path" in capsys.readouterr().err
    ns = parse_engine_args("sglang", ["--model-path", "m", "--tp-size", "2"])
    assert (ns.model_path, ns.tensor_parallel_size, ns.port, ns.host) == (
        "m",
        2,
        30000,
        "127.0.0.1",
    )


def test_llama_server_flags_and_unknown_flag(capsys: pytest.CaptureFixture[str]) -> None:
    ns = parse_engine_args(
        "llama-server", ["-m", "/m.gguf", "-c", "8192", "-t", "4", "--alias", "x", "--metrics"]
    )
    assert (ns.model, ns.ctx_size, ns.threads, ns.alias, ns.metrics) == (
        "/m.gguf", 8192, 4, "x", True,
    )  # fmt: skip
    assert ns.port == 8080
    with pytest.raises(SystemExit) as exc:
        parse_engine_args("llama-server", ["-m", "x", "--bogus"])
    assert exc.value.code == 1
    assert "error: invalid argument: --bogus" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "value"), [("4096", 4096), ("32k", 32000), ("32K", 32768), ("1M", 2**20)]
)
def test_human_readable_int(text: str, value: int) -> None:
    assert human_readable_int(text) == value


def test_human_readable_int_rejects_garbage() -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        human_readable_int("lots")
