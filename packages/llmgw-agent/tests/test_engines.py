"""The engines installed: version and flags read from the engine itself, cached."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from llmgw_agent.engines import load_engine, metadata_version_argv, parse_version
from llmgw_proto import v1

# An engine that answers --version and --help as vLLM does (argparse help), and counts
# how often its help was asked for.
ENGINE = textwrap.dedent(
    """
    import argparse, sys
    args = sys.argv[1:]
    if args == ["--version"]:
        with open(sys.argv[0] + ".versions", "a") as f:
            f.write("x")
        print("INFO some log line"); print("0.32.0"); sys.exit(0)
    if args[:2] == ["serve", "--help=all"]:
        with open(sys.argv[0] + ".count", "a") as f:
            f.write("x")
        p = argparse.ArgumentParser(prog="vllm serve")
        p.add_argument("--max-model-len")
        p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction)
        p.add_argument("--port")
        p.print_help(); sys.exit(0)
    sys.exit(3)
    """
)


def engine(tmp_path: Path, code: str = ENGINE) -> list[str]:
    script = tmp_path / "engine.py"
    script.write_text(code)
    return [sys.executable, str(script)]


def test_flags_and_version_read_from_the_engine_and_cached(tmp_path: Path) -> None:
    command = engine(tmp_path)
    state = tmp_path / "state"
    first = load_engine("vllm", command, "", state)
    assert first.error == ""
    assert first.version == "0.32.0"
    assert first.spec is not None
    assert first.spec.accepts("--no-enforce-eager")
    assert not first.spec.accepts("--swap-space")
    info = first.info()
    assert info.kind == v1.EngineKind.VLLM
    assert info.executable == sys.executable
    # Read once per executable and version: the second agent start uses the cache.
    second = load_engine("vllm", command, "", state)
    assert second.spec == first.spec
    assert (tmp_path / "engine.py.count").read_text() == "x"


def test_an_unchanged_executable_is_not_asked_its_version_again(tmp_path: Path) -> None:
    script = tmp_path / "vllm"
    script.write_text(f"#!{sys.executable}\n" + ENGINE)
    script.chmod(0o755)
    state = tmp_path / "state"
    assert load_engine("vllm", [str(script)], "", state).version == "0.32.0"
    assert load_engine("vllm", [str(script)], "", state).version == "0.32.0"
    assert (tmp_path / "vllm.versions").read_text() == "x"
    # A reinstall changes the executable: asked again.
    script.write_text(f"#!{sys.executable}\n" + ENGINE + "\n# 0.33\n")
    assert load_engine("vllm", [str(script)], "", state).version == "0.32.0"
    assert (tmp_path / "vllm.versions").read_text() == "xx"
    assert len(list((state / "engine-help").glob("vllm-0.32.0-*.txt"))) == 1


def test_vllms_version_comes_from_its_package_metadata_without_importing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A console script as pip writes it, and the `vllm` distribution's metadata on its path.
    script = tmp_path / "vllm"
    script.write_text(f"#!{sys.executable}\n" + ENGINE)
    script.chmod(0o755)
    site = tmp_path / "site"
    (site / "vllm-0.40.1.dist-info").mkdir(parents=True)
    (site / "vllm-0.40.1.dist-info" / "METADATA").write_text("Name: vllm\nVersion: 0.40.1\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    found = load_engine("vllm", [str(script)], "", tmp_path / "state")
    assert (found.version, found.error) == ("0.40.1", "")
    assert not (tmp_path / "vllm.versions").exists()  # `vllm --version` never ran
    assert found.spec is not None
    assert found.spec.accepts("--max-model-len")


def test_without_metadata_the_version_is_asked_of_the_engine(tmp_path: Path) -> None:
    script = tmp_path / "vllm"
    script.write_text("#!/usr/bin/env python3\n" + ENGINE)
    script.chmod(0o755)
    assert metadata_version_argv("vllm", str(script)) is not None
    assert metadata_version_argv("vllm", "/usr/bin/true") is None
    assert metadata_version_argv("llamacpp", sys.executable) is None
    assert load_engine("vllm", [str(script)], "", tmp_path / "state").version == "0.32.0"
    assert (tmp_path / "vllm.versions").read_text() == "x"  # asked, as before


def test_an_engine_whose_help_cannot_be_read_is_reported(tmp_path: Path) -> None:
    broken = engine(tmp_path, "import sys\nprint('0.1.0') if '--version' in sys.argv else 0\n"
                              "sys.exit(0 if '--version' in sys.argv else 1)\n")  # fmt: skip
    found = load_engine("vllm", broken, "", tmp_path / "state")
    assert found.spec is None
    assert found.version == "0.1.0"
    assert "serve --help=all` exited 1" in found.error
    missing = load_engine("llamacpp", ["no-such-llama-server"], "", tmp_path / "state")
    assert missing.error == "engine executable 'no-such-llama-server' not found on PATH"
    assert missing.info().error == missing.error


def test_flags_from_captured_or_a_file(tmp_path: Path) -> None:
    captured = load_engine("llamacpp", ["llama-server"], "captured", tmp_path)
    assert (captured.version, captured.error) == ("b11434", "")
    assert (
        "flags_from 'captured:9.9'" in load_engine("vllm", ["vllm"], "captured:9.9", tmp_path).error
    )
    saved = tmp_path / "help.txt"
    saved.write_text("usage: x\n\noptions:\n  --tp-size TP_SIZE\n")
    from_file = load_engine(
        "sglang", ["python", "-m", "sglang.launch_server"], str(saved), tmp_path
    )
    assert from_file.spec is not None
    assert from_file.spec.takes_value("--tp-size")
    gone = load_engine("sglang", ["x"], str(tmp_path / "nope"), tmp_path)
    assert gone.error.startswith(f"flags_from '{tmp_path / 'nope'}': ")
    assert gone.spec is None


def test_parse_version() -> None:
    assert parse_version("vllm", "WARNING torch\n0.32.0\n") == "0.32.0"
    assert parse_version("sglang", "0.5.23\n") == "0.5.23"
    assert parse_version("llamacpp", "version: 11434 (a1b2c3)\nbuilt with cc\n") == "b11434"
    numbered = "version: 0.6.0-dev (build 11434, commit a1b2c3)\nbuilt with GNU 12.2.0\n"
    assert parse_version("llamacpp", numbered) == "b11434"
    # From a source archive: no build number, known by its release (was read as "b0").
    unnumbered = "version: 0.6.0-dev (build 0, commit unknown)\n"
    assert parse_version("llamacpp", unnumbered) == "0.6.0-dev"
    assert parse_version("llamacpp", "version: 0 (unknown)\n") == ""
    assert parse_version("vllm", "usage: error\n") == ""


def test_inventory_lists_the_engines(tmp_path: Path) -> None:
    import json
    import subprocess

    config = tmp_path / "agent.yaml"
    config.write_text(
        f"simulate_gpus: {{count: 1}}\nstate_dir: {tmp_path / 'state'}\nengines:\n"
        "  vllm: {command: [vllm], flags_from: captured}\n"
        "  sglang: {command: [no-such-python, -m, sglang.launch_server]}\n"
        "  llamacpp: {command: [no-such-llama-server]}\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "llmgw_agent", "inventory", "--config", str(config), "--engines",
         "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    engines = {e["kind"]: e for e in json.loads(out.stdout)["engines"]}
    assert engines["ENGINE_KIND_VLLM"]["version"] == "0.32.0"
    assert engines["ENGINE_KIND_VLLM"]["error"] == ""
    assert "not found on PATH" in engines["ENGINE_KIND_LLAMACPP"]["error"]
    assert "not found on PATH" in engines["ENGINE_KIND_SGLANG"]["error"]
