"""The demo says where things are (issue 29 point 6): the status page's URL and the
exact command that runs the CLI from another terminal (the programs are in the
demo's environment, not on the user's PATH), and it labels the simulator's text as
simulated. The command it prints is run as printed, and answers.

The demo runs from a copy of tools/demo.py and examples/local/ on free ports (as
test_demo does), and is stopped by its process group, whatever happens.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from llmgw_testkit import engine_port_range, free_port, wait_for

REPO = Path(__file__).resolve().parent.parent


def copy_demo(tmp_path: Path) -> tuple[Path, int]:
    root = tmp_path / "repo"
    (root / "tools").mkdir(parents=True)
    shutil.copy(REPO / "tools" / "demo.py", root / "tools" / "demo.py")
    shutil.copytree(
        REPO / "examples" / "local",
        root / "examples" / "local",
        ignore=shutil.ignore_patterns("certs", "*-state"),
    )
    ports = {old: free_port() for old in (7070, 9091, 8080, 9090)}
    lo, hi = engine_port_range(salt=97)
    for config in (root / "examples" / "local").glob("*.yaml"):
        text = config.read_text()
        for old, new in ports.items():
            text = text.replace(f"127.0.0.1:{old}", f"127.0.0.1:{new}")
        text = text.replace("port_range: [21000, 21999]", f"port_range: [{lo}, {hi}]")
        config.write_text(text)
    return root, ports[9091]


def started_under(root: Path) -> list[int]:
    """Live processes whose command line names a path under ``root``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if str(root).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


def test_the_demo_prints_the_page_and_a_cli_command_that_works(tmp_path: Path) -> None:
    root, admin = copy_demo(tmp_path)
    log_path = root / "demo.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(root / "tools" / "demo.py")],
            cwd=root,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:

        def up() -> bool:
            text = log_path.read_text(errors="replace")
            assert proc.poll() is None, f"the demo exited with {proc.returncode}:\n{text}"
            return "Ctrl-C stops everything" in text

        wait_for(up, timeout=300, interval=0.2, what="the demo to come up")
        text = log_path.read_text(errors="replace")
        assert f"the status page: http://127.0.0.1:{admin}/" in text, text
        assert "(simulated: llmgw-sim stands in for the engine" in text, text
        found = re.search(r"the CLI, from another terminal: (.+)", text)
        assert found, text
        argv = shlex.split(found.group(1))
        assert argv[-2:] == ["--admin", f"127.0.0.1:{admin}"], argv
        # As a user would: a shell without the demo's environment on PATH.
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "LLMGW_ADMIN")}
        env["PATH"] = "/usr/bin:/bin"
        status = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
        assert status.returncode in (0, 3), status.stderr
        assert "REPLICA" in status.stdout, status.stdout
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        # Whatever the demo left (its programs name their configs under root), by pid.
        for pid in started_under(root):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
