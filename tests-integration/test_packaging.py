"""The four wheels stay four: who may import whom, and what a GPU node installs."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROGRAMS = ("llmgw_router", "llmgw_control", "llmgw_agent")


def imported_modules(package_src: Path) -> dict[str, set[str]]:
    """Top-level module names each source file imports (absolute imports only)."""
    found: dict[str, set[str]] = {}
    for path in package_src.rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(REPO))] = names
    return found


def boundary_violations(program: str, package_src: Path) -> list[str]:
    others = set(PROGRAMS) - {program}
    return [
        f"{file} imports {sorted(names & others)}"
        for file, names in imported_modules(package_src).items()
        if names & others
    ]


@pytest.mark.parametrize("program", PROGRAMS)
def test_programs_do_not_import_each_other(program: str) -> None:
    package = REPO / "packages" / program.replace("_", "-")
    assert boundary_violations(program, package / "src") == []
    assert boundary_violations(program, package / "tests") == []


def test_boundary_check_catches_a_cross_import(tmp_path: Path) -> None:
    (tmp_path / "x.py").write_text("import os\nfrom llmgw_control.catalog import Catalog\n")
    # The scan reports files relative to the repo, so put the sample inside it.
    sample = REPO / ".cache" / "boundary-sample"
    sample.mkdir(parents=True, exist_ok=True)
    (sample / "x.py").write_text((tmp_path / "x.py").read_text())
    try:
        assert boundary_violations("llmgw_router", sample) == [
            ".cache/boundary-sample/x.py imports ['llmgw_control']"
        ]
        assert boundary_violations("llmgw_control", sample) == []
    finally:
        (sample / "x.py").unlink()


@pytest.mark.parametrize("program", PROGRAMS)
def test_programs_depend_on_proto_and_not_on_each_other(program: str) -> None:
    name = program.replace("_", "-")
    meta = tomllib.loads((REPO / "packages" / name / "pyproject.toml").read_text())
    deps = [
        d.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip()
        for d in meta["project"]["dependencies"]
    ]
    assert "llmgw-proto" in deps
    assert not {"llmgw-router", "llmgw-control", "llmgw-agent"} & set(deps)


def test_agent_alone_installs_without_the_router_stack(tmp_path: Path) -> None:
    """A GPU node runs `pip install llmgw-agent`: no HTTP server stack comes with it."""
    wheels = tmp_path / "wheels"
    for name in ("llmgw-proto", "llmgw-agent"):
        subprocess.run(
            [sys.executable, "-m", "uv", "build", "--wheel", "--out-dir", str(wheels), "-q",
             str(REPO / "packages" / name)],
            check=True,
            timeout=300,
        )  # fmt: skip
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "uv", "venv", "-q", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "uv", "pip", "install", "-q", "-p", str(python),
         "--find-links", str(wheels), *map(str, sorted(wheels.glob("*.whl")))],
        check=True,
        timeout=600,
    )  # fmt: skip
    probe = (
        "import importlib.util as u, json; "
        "print(json.dumps({m: u.find_spec(m) is not None for m in "
        "['llmgw_agent', 'llmgw_proto', 'grpclib', 'pynvml', "
        "'starlette', 'hypercorn', 'aiohttp', 'uvicorn', 'llmgw_router', 'llmgw_control']}))"
    )
    import json

    found = json.loads(subprocess.check_output([str(python), "-c", probe], text=True))
    assert found == {
        "llmgw_agent": True,
        "llmgw_proto": True,
        "grpclib": True,
        "pynvml": True,
        "starlette": False,
        "hypercorn": False,
        "aiohttp": False,
        "uvicorn": False,
        "llmgw_router": False,
        "llmgw_control": False,
    }
    help_text = subprocess.check_output([str(venv / "bin" / "llmgw-agent"), "--help"], text=True)
    assert "llmgw-agent" in help_text
