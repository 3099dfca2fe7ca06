"""One control plane per SQLite state_dir (issue 24.8).

Two control planes on one directory both started and both wrote. The store now holds
an exclusive lock on ``<state_dir>/LOCK`` (the holder's pid in it) for the process's
life; a second one is refused, naming the directory and that pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from llmgw_control.store import StoreError
from llmgw_control.store.sqlite import SqliteStore
from llmgw_testkit import Proc, free_port, http_get, wait_for


async def test_a_second_store_on_the_directory_is_refused_naming_the_holder(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    first = SqliteStore(state)
    await first.open()
    assert (state / "LOCK").read_text() == f"{os.getpid()}\n"
    with pytest.raises(StoreError) as err:
        await SqliteStore(state).open()
    text = str(err.value)
    assert f"state directory {state} (state.state_dir) is in use" in text
    assert f"pid {os.getpid()}" in text
    await first.close()
    # Closed, the lock is free again: the same directory opens (and reads) as before.
    again = SqliteStore(state)
    await again.open()
    assert await again.load() == {}
    await again.close()


async def test_a_store_that_cannot_be_read_leaves_the_lock_free(tmp_path: Path) -> None:
    (tmp_path / "control.db").write_bytes(b"no database" * 200)
    with pytest.raises(StoreError, match="cannot be read"):
        await SqliteStore(tmp_path).open()
    (tmp_path / "control.db").unlink()
    store = SqliteStore(tmp_path)
    await store.open()
    await store.close()


def config(tmp_path: Path, name: str, state_dir: Path) -> tuple[Path, int]:
    admin = free_port()
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "listen": f"127.0.0.1:{free_port()}",
                "admin_listen": f"127.0.0.1:{admin}",
                "tls": {"insecure": True},
                "state": {"state_dir": str(state_dir)},
            }
        )
    )
    return path, admin


def serve_argv(path: Path) -> list[str]:
    return [sys.executable, "-m", "llmgw_control", "serve", "--config", str(path)]


def healthy(port: int) -> bool:
    try:
        return http_get(f"http://127.0.0.1:{port}/healthz")[0] == 200
    except OSError:
        return False


def test_two_control_planes_on_one_state_dir(tmp_path: Path) -> None:
    state = tmp_path / "shared-state"
    first_config, first_admin = config(tmp_path, "first", state)
    second_config, second_admin = config(tmp_path, "second", state)
    with Proc(serve_argv(first_config), log_dir=tmp_path / "logs", name="first") as first:
        wait_for(
            lambda: healthy(first_admin) or not first.alive(), timeout=60, what="first /healthz"
        )
        assert first.alive(), first.tail()
        done = subprocess.run(serve_argv(second_config), capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert lines[0].startswith("error: state store: state directory ")
        assert str(state) in lines[0]
        assert f"pid {first.pid}" in lines[0]
        # The first still serves, its lock untouched.
        assert first.alive()
        assert healthy(first_admin)
        assert (state / "LOCK").read_text() == f"{first.pid}\n"
        # Killed outright, it takes the lock with it: the LOCK file (with a dead pid
        # in it) does not keep the next control plane out.
        first.signal(signal.SIGKILL)
        first.wait()
    with Proc(serve_argv(second_config), log_dir=tmp_path / "logs", name="second") as second:
        wait_for(
            lambda: healthy(second_admin) or not second.alive(),
            timeout=60,
            what="second /healthz",
        )
        assert second.alive(), second.tail()
        assert (state / "LOCK").read_text() == f"{second.pid}\n"
