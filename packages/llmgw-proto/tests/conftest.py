from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from llmgw_testkit import untimed

untimed.load()  # no hypothesis deadlines: tests assert no timings

PACKAGE = Path(__file__).resolve().parent.parent
REPO = PACKAGE.parent.parent


@pytest.fixture(scope="session")
def protoc_modules(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModuleType]:
    """protoc's own Python output (the google.protobuf runtime) for our .proto files."""
    out = tmp_path_factory.mktemp("pb2")
    proto_dir = PACKAGE / "proto"
    files = sorted(str(p.relative_to(proto_dir)) for p in proto_dir.rglob("*.proto"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{proto_dir}",
            f"--python_out={out}",
            *files,
        ],
        check=True,
    )
    sys.path.insert(0, str(out))
    try:
        return {
            name: importlib.import_module(f"llmgw.v1.{name}_pb2")
            for name in ("common", "agent", "endpoint")
        }
    finally:
        sys.path.remove(str(out))
