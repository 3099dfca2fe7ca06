"""The committed generated code must be what tools/gen_proto.py makes from the .proto files."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent
GEN = PACKAGE.parent.parent / "tools" / "gen_proto.py"


def check(package: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(GEN), "--check", "--package", str(package)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_committed_code_is_fresh() -> None:
    done = check(PACKAGE)
    assert done.returncode == 0, done.stdout + done.stderr


def copy_package(tmp_path: Path) -> Path:
    copy = tmp_path / "llmgw-proto"
    shutil.copytree(PACKAGE / "proto", copy / "proto")
    shutil.copytree(PACKAGE / "src", copy / "src", ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_check_fails_when_a_proto_changed(tmp_path: Path) -> None:
    copy = copy_package(tmp_path)
    endpoint = copy / "proto" / "llmgw" / "v1" / "endpoint.proto"
    text = endpoint.read_text()
    endpoint.write_text(
        text.replace("message WatchRequest {", "message WatchRequest {\n  bool x = 99;")
    )
    done = check(copy)
    assert done.returncode == 1
    assert "stale" in done.stdout
    assert "differs: _gen/llmgw/v1/__init__.py" in done.stdout


def test_check_fails_when_generated_code_was_edited(tmp_path: Path) -> None:
    copy = copy_package(tmp_path)
    facade = copy / "src" / "llmgw_proto" / "v1.py"
    facade.write_text(facade.read_text() + "# edited by hand\n")
    done = check(copy)
    assert done.returncode == 1
    assert "differs: v1.py" in done.stdout


def test_check_fails_when_a_generated_file_is_missing(tmp_path: Path) -> None:
    copy = copy_package(tmp_path)
    (copy / "src" / "llmgw_proto" / "_gen" / "message_pool.py").unlink()
    done = check(copy)
    assert done.returncode == 1
    assert "missing: _gen/message_pool.py" in done.stdout
