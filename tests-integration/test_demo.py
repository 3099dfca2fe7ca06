"""tools/demo.py never orphans a process, and names whoever holds a port it needs.

The demo runs from a copy of the repository's tools/demo.py and examples/local/ whose
configs listen on free ports, so it cannot meet another run. Ctrl-C is SIGINT to the
demo's process; `nox -s demo` follows a Ctrl-C with SIGTERM 0.3 s later.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from llmgw_testkit import engine_port_range, free_port, wait_for

REPO = Path(__file__).resolve().parent.parent


def demo_copy(tmp_path: Path) -> tuple[Path, dict[int, int]]:
    """tools/demo.py and examples/local/ under tmp_path, on free ports (old -> new)."""
    root = tmp_path / "repo"
    (root / "tools").mkdir(parents=True)
    shutil.copy(REPO / "tools" / "demo.py", root / "tools" / "demo.py")
    shutil.copytree(
        REPO / "examples" / "local",
        root / "examples" / "local",
        ignore=shutil.ignore_patterns("certs", "*-state"),
    )
    ports = {old: free_port() for old in (7070, 9091, 8080, 9090)}
    lo, hi = engine_port_range(salt=89)
    for config in (root / "examples" / "local").glob("*.yaml"):
        text = config.read_text()
        for old, new in ports.items():
            text = text.replace(f"127.0.0.1:{old}", f"127.0.0.1:{new}")
        text = text.replace("port_range: [21000, 21999]", f"port_range: [{lo}, {hi}]")
        config.write_text(text)
    return root, ports


def start_time(pid: int) -> str | None:
    """The process's start time (so a reused pid is not mistaken for it); None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else fields[19]  # a zombie has exited


def descendants(pid: int) -> dict[int, tuple[str, str]]:
    """Every live process under ``pid``: pid -> (start time, command line)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                parents[int(entry.name)] = int(
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
                )
    found: dict[int, tuple[str, str]] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in found:
                began = start_time(child)
                with contextlib.suppress(OSError):
                    argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
                    if began is not None:
                        found[child] = (began, " ".join(a.decode() for a in argv if a))
                        frontier.append(child)
    return found


@contextlib.contextmanager
def demo(root: Path, *args: str) -> Iterator[subprocess.Popen[str]]:
    log = (root / "demo.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, str(root / "tools" / "demo.py"), *args],
        cwd=root,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    seen: dict[int, tuple[str, str]] = {}
    try:
        yield proc
    finally:
        seen = descendants(proc.pid)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        log.close()
        for pid, (began, _) in seen.items():  # whatever a failed run left behind
            if start_time(pid) == began:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def output(root: Path) -> str:
    return (root / "demo.log").read_text(errors="replace")


@pytest.mark.parametrize(
    "signals",
    [
        [signal.SIGINT, signal.SIGINT],  # Ctrl-C twice
        # What `nox -s demo` does on Ctrl-C: SIGINT, SIGTERM 0.3 s later, SIGKILL 0.2 s later.
        [signal.SIGINT, signal.SIGTERM, signal.SIGKILL],
    ],
    ids=["ctrl-c-twice", "nox"],
)
def test_a_second_signal_while_stopping_still_stops_everything(
    tmp_path: Path, signals: list[int]
) -> None:
    root, _ = demo_copy(tmp_path)
    with demo(root) as proc:
        deadline = time.monotonic() + 240
        while "Ctrl-C stops everything" not in output(root):
            assert proc.poll() is None, f"the demo exited with {proc.returncode}:\n{output(root)}"
            assert time.monotonic() < deadline, f"the demo did not come up:\n{output(root)}"
            time.sleep(0.2)
        started = descendants(proc.pid)
        commands = [cmd for _, cmd in started.values()]
        assert sum("llmgw-control serve" in c for c in commands) == 1, commands
        assert sum("llmgw-agent run" in c for c in commands) == 2, commands
        # The router: a supervisor and its worker processes.
        assert sum("llmgw-router serve" in c for c in commands) >= 1, commands
        # tiny-chat: 2 replicas of 1 shard, big-chat: 1 replica of 2 shards.
        assert sum("llmgw-sim vllm" in c for c in commands) == 4, commands

        for i, sig in enumerate(signals):
            if i:  # each later signal lands while the demo is stopping things
                time.sleep(0.3 if i == 1 else 0.2)
            proc.send_signal(sig)
        proc.wait(timeout=120)

        def left() -> list[str]:
            return [
                f"{pid} {cmd}" for pid, (began, cmd) in started.items() if start_time(pid) == began
            ]

        # Killed, the demo cannot stop anything itself: its reaper does, within its grace.
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: not left(), timeout=60, what="orphans to go")
        assert left() == [], f"the demo left these running:\n{output(root)}"
        text = output(root)
        assert "Traceback" not in text, text
        assert "KeyboardInterrupt" not in text, text
        assert "already stopping" in text
        if signal.SIGKILL in signals:
            assert "the demo went away: stopping what it started" in text, text
        else:
            assert text.rstrip().endswith("==> stopped"), text


def test_a_taken_port_is_named_with_who_holds_it(tmp_path: Path) -> None:
    root, ports = demo_copy(tmp_path)
    admin = ports[9091]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", admin))
        holder.listen()
        with demo(root, "--once") as proc:
            proc.wait(timeout=120)
    text = output(root)
    assert proc.returncode != 0, text
    assert "Traceback" not in text, text
    line = next((x for x in text.splitlines() if f"{admin} (control admin)" in x), None)
    assert line is not None, text
    assert re.search(rf"held by pid {os.getpid()}: \S*python", line), line
    assert not (root / "examples" / "local" / "certs").exists(), "it started anyway"
