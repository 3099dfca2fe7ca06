"""A port already in use (issue 29 point 8): every program names the setting, the
address and the process holding it, and exits 2 before starting anything, in every
router worker mode (with `workers: 1`, uvicorn printed its own lines and exited 3).

The port is held by a process the test starts (and stops by its pid).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from llmgw_proto.ports import listeners
from llmgw_testkit import free_port
from llmgw_testkit.cluster import bin_path

HOLD = (
    "import socket, sys, time\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); print('held', flush=True)\n"
    "time.sleep(600)\n"
)


@pytest.fixture
def held(tmp_path: Path) -> Iterator[tuple[int, int]]:
    """(port, pid) of a port a separate process listens on."""
    port = free_port()
    script = tmp_path / "port-holder-for-llmgw-test.py"
    script.write_text(HOLD)
    holder = subprocess.Popen(
        [sys.executable, str(script), str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        yield port, holder.pid
    finally:
        holder.kill()
        holder.wait(timeout=30)


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def said(done: subprocess.CompletedProcess[str], setting: str, port: int, pid: int) -> None:
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    err = done.stderr
    assert f"{setting} 127.0.0.1:{port} is already in use" in err, err
    assert f"by pid {pid}: " in err, err
    assert "port-holder-for-llmgw-test" in err, err
    assert "Traceback" not in err + done.stdout
    assert "Uvicorn" not in err + done.stdout, "uvicorn's own lines"


@pytest.mark.parametrize("setting", ["listen", "admin_listen"])
def test_control_plane(tmp_path: Path, held: tuple[int, int], setting: str) -> None:
    port, pid = held
    addresses = {"listen": f"127.0.0.1:{free_port()}", "admin_listen": f"127.0.0.1:{free_port()}"}
    addresses[setting] = f"127.0.0.1:{port}"
    config = tmp_path / "control.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                **addresses,
                "tls": {"insecure": True},
                "state": {"state_dir": str(tmp_path / "state")},
                "models": [{"name": "m", "profiles": {"p": {"engine": "vllm"}}}],
            }
        )
    )
    said(run([bin_path("llmgw-control"), "serve", "--config", str(config)]), setting, port, pid)


@pytest.mark.parametrize(
    ("setting", "workers"), [("listen", 1), ("listen", 2), ("admin_listen", 1), ("admin_listen", 2)]
)
def test_router(tmp_path: Path, held: tuple[int, int], setting: str, workers: int) -> None:
    port, pid = held
    addresses = {"listen": f"127.0.0.1:{free_port()}", "admin_listen": f"127.0.0.1:{free_port()}"}
    addresses[setting] = f"127.0.0.1:{port}"
    config = tmp_path / "router.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                **addresses,
                "workers": workers,
                "endpoints": [{"id": "e1", "url": "http://127.0.0.1:9", "models": ["m"]}],
            }
        )
    )
    said(run([bin_path("llmgw-router"), "serve", "--config", str(config)]), setting, port, pid)
    # A flag names itself.
    flagged = run(
        [
            bin_path("llmgw-router"),
            "serve",
            "--config",
            str(config),
            "--listen",
            f"127.0.0.1:{port}",
        ]
    )
    if setting == "listen":
        said(flagged, "--listen", port, pid)


def test_listeners_parses_proc_net_tcp() -> None:
    table = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 12345 1\n"
        "   1: 0100007F:1F91 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 23456 1\n"
        "   2: 00000000000000000000000000000000:0050 00000000000000000000000000000000:0000 0A x x x 0 0 777 1\n"
        "garbage\n"
    )
    assert listeners(table) == [(8080, 12345), (80, 777)]
