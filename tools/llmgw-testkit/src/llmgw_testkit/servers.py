"""Real etcd and PostgreSQL servers for tests, on loopback free ports, in a temp dir.

Both come from Debian's packages (``etcd-server``, ``postgresql``; .ci/run installs
them). Each server is a :class:`~llmgw_testkit.Proc`, stopped by its pid. Where a
server cannot be started a test is skipped, except in CI (``CI=true``), where it
fails: a green CI must not hide a missing install step.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path

from llmgw_testkit import Proc, free_port, port_open, wait_for

__all__ = ["Etcd", "Postgres", "unavailable"]


def unavailable(why: str) -> None:
    """Skip outside CI; fail in CI."""
    import pytest

    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{why} (CI=true: a server the tests need must be installed)")
    pytest.skip(why)


class Etcd:
    """One etcd member; ``endpoint`` is its client address (host:port)."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            unavailable("etcd is not installed (Debian package etcd-server)")
            raise AssertionError("unreachable")
        self.port = free_port()
        peer = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        data = workdir / "etcd-data"
        data.mkdir(parents=True, exist_ok=True)
        client_url = f"http://127.0.0.1:{self.port}"
        peer_url = f"http://127.0.0.1:{peer}"
        self.proc = Proc(
            [
                binary,
                "--name=test",
                f"--data-dir={data}",
                f"--listen-client-urls={client_url}",
                f"--advertise-client-urls={client_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=test={peer_url}",
                "--log-level=warn",
            ],
            log_dir=workdir / "logs",
            name="etcd",
            env={"ETCD_UNSUPPORTED_ARCH": os.environ.get("ETCD_UNSUPPORTED_ARCH", "")},
        )
        try:
            wait_for(self._healthy, timeout=60, what="etcd /health")
        except TimeoutError:
            tail = self.proc.tail()
            self.stop()
            unavailable(f"etcd did not start:\n{tail}")

    def _healthy(self) -> bool:
        if not self.proc.alive():
            raise AssertionError(f"etcd exited:\n{self.proc.tail()}")
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=2) as resp:
                return b"true" in resp.read()
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.stop()


def _pg_bin(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


class Postgres:
    """A PostgreSQL cluster of its own; ``dsn`` reaches database ``llmgw`` as ``llmgw``."""

    USER = "llmgw"
    PASSWORD = "llmgw-test-password"  # noqa: S105 - a throwaway test cluster

    def __init__(self, workdir: Path) -> None:
        initdb, postgres = _pg_bin("initdb"), _pg_bin("postgres")
        if initdb is None or postgres is None:
            unavailable("PostgreSQL is not installed (Debian package postgresql)")
            raise AssertionError("unreachable")
        self.port = free_port()
        # Its own directory straight under the temp dir: as root, PostgreSQL runs as the
        # postgres user, which cannot enter pytest's private (0700) temp tree.
        root = Path(tempfile.mkdtemp(prefix="llmgw-pg-"))
        self.root = root
        data, sockets = root / "data", root / "run"
        sockets.mkdir(parents=True, exist_ok=True)
        pwfile = root / "pw"
        pwfile.write_text(self.PASSWORD + "\n")
        prefix: list[str] = []
        if os.geteuid() == 0:
            prefix = ["setpriv", "--reuid=postgres", "--regid=postgres", "--clear-groups", "--"]
            subprocess.run(["chown", "-R", "postgres:postgres", str(root)], check=True)
        done = subprocess.run(
            [
                *prefix,
                initdb,
                f"--pgdata={data}",
                f"--username={self.USER}",
                f"--pwfile={pwfile}",
                "--auth=scram-sha-256",
                "--encoding=UTF8",
                "--no-sync",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            unavailable(f"initdb failed: {done.stderr.strip()[-2000:]}")
        self.proc = Proc(
            [
                *prefix,
                postgres,
                "-D",
                str(data),
                "-p",
                str(self.port),
                "-k",
                str(sockets),
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=off",
            ],
            log_dir=workdir / "logs",
            name="postgres",
        )
        try:
            self.proc.wait_output("database system is ready to accept connections", timeout=60)
            wait_for(lambda: port_open(self.port) or self._died(), timeout=60, what="postgres port")
        except (TimeoutError, AssertionError):
            tail = self.proc.tail()
            self.stop()
            unavailable(f"postgres did not start:\n{tail}")
        self.dsn = f"postgresql://{self.USER}:{self.PASSWORD}@127.0.0.1:{self.port}/postgres"

    def dsn_with(self, password: str) -> str:
        return f"postgresql://{self.USER}:{password}@127.0.0.1:{self.port}/postgres"

    def _died(self) -> bool:
        if not self.proc.alive():
            raise AssertionError(f"postgres exited:\n{self.proc.tail()}")
        return False

    def stop(self) -> None:
        # SIGINT is PostgreSQL's "fast shutdown".
        import signal

        self.proc.stop(signal.SIGINT)
        shutil.rmtree(self.root, ignore_errors=True)
