"""`llmgw-router serve` refuses bad input with a located message, exit 2, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from llmgw_router.cli import main
from llmgw_router.config import parse_endpoint_flag

ROUTER = str(Path(sys.executable).parent / "llmgw-router")


class Outcome:
    def __init__(self, returncode: int, stderr: str) -> None:
        self.returncode = returncode
        self.stderr = stderr


def run(*args: str) -> Outcome:
    """`llmgw-router serve ARGS` in this process: the same code, without a second start-up."""
    result = CliRunner().invoke(main, ["serve", *args])
    return Outcome(result.exit_code, result.stderr)


def test_bad_endpoint_flag_as_a_real_process() -> None:
    result = subprocess.run(
        [ROUTER, "serve", "--endpoint", "e1=http://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert (
        result.stderr
        == "error: --endpoint: expected id=URL=model[,model], got 'e1=http://127.0.0.1:1'\n"
    )


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        ("e1=http://127.0.0.1:1", "expected id=URL=model"),
        ("e1=ftp://x:1=m", "must start with http://"),
        ("=http://127.0.0.1:1=m", "empty endpoint id"),
        ("e1=http://127.0.0.1:1=,", "no model names"),
    ],
)
def test_bad_endpoint_flag(flag: str, expected: str) -> None:
    result = run("--endpoint", flag)
    assert result.returncode == 2
    assert result.stderr.startswith("error: --endpoint: ")
    assert expected in result.stderr
    assert "Traceback" not in result.stderr


def test_duplicate_endpoint_flag_is_named() -> None:
    result = run("--endpoint", "a=http://127.0.0.1:1=m", "--endpoint", "a=http://127.0.0.1:2=m")
    assert result.returncode == 2
    assert "--endpoint: duplicate endpoint id 'a'" in result.stderr


def test_config_errors_name_file_and_field(tmp_path: Path) -> None:
    cfg = tmp_path / "router.yaml"
    cfg.write_text(
        "endpoints:\n  - id: a\n    url: http://127.0.0.1:1\n    models: [m]\n    weight: 0\n"
    )
    result = run("--config", str(cfg))
    assert result.returncode == 2
    assert f"{cfg}: $.endpoints[0].weight: Expected `int` >= 1" in result.stderr
    cfg.write_text("deadlines:\n  idle: soon\n")
    result = run("--config", str(cfg))
    assert result.returncode == 2
    assert "$.deadlines.idle" in result.stderr
    cfg.write_text("balancer: fastest\nendpoints: []\n")
    assert "$.balancer" in run("--config", str(cfg)).stderr
    cfg.write_text("control:\n  address: 127.0.0.1:7070\n")
    result = run("--config", str(cfg))
    assert result.returncode == 2
    assert "$.control.tls.cert: required unless control.tls.insecure is true" in result.stderr
    cfg.write_text("listen: 8080\nendpoints: []\n")
    assert "$.listen" in run("--config", str(cfg)).stderr


def test_bad_listen_flag_and_no_endpoints() -> None:
    result = run("--endpoint", "a=http://127.0.0.1:1=m", "--listen", "nohost")
    assert result.returncode == 2
    assert "--listen: Expected HOST:PORT" in result.stderr
    result = run()
    assert result.returncode == 2
    assert "no endpoints" in result.stderr


def test_parse_endpoint_flag() -> None:
    ep = parse_endpoint_flag("gpu-a=http://10.0.0.5:8000/=llama,llama-chat")
    assert (ep.id, ep.url, ep.models, ep.profile, ep.weight) == (
        "gpu-a",
        "http://10.0.0.5:8000",
        ["llama", "llama-chat"],
        "static",
        1,
    )
