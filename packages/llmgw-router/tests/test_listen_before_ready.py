"""A router of one process (`workers: 1`) listens before its admin server does: from the moment the
admin port takes a connection (so before `/readyz` can say 200), a connection to the
proxy is taken, never refused.

The proxy's server used to bind in a task started beside the admin server's, so a
client that connected as soon as `/readyz` said 200 could be refused (seen once in a
loaded unit run: test_http_limits' raw-socket connect got ECONNREFUSED). The window
is milliseconds wide, so this test watches the admin port as closely as it can and
tries the proxy at once, several times over; it is a check of the order, which a
quiet machine rarely catches reversed.
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest
import yaml
from llmgw_testkit import Proc, free_port

ROUTER = str(Path(sys.executable).parent / "llmgw-router")


def _taken(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


@pytest.mark.parametrize("server", ["uvicorn", "hypercorn"])
def test_the_proxy_listens_before_the_admin_server(tmp_path: Path, server: str) -> None:
    for attempt in range(5):
        port, admin = free_port(), free_port()
        path = tmp_path / f"router-{attempt}.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "listen": f"127.0.0.1:{port}",
                    "admin_listen": f"127.0.0.1:{admin}",
                    "server": server,
                    # One process: with workers, the supervisor's /readyz asks each worker's,
                    # which a worker serves only after it listens.
                    "workers": 1,
                    "endpoints": [
                        {"id": "e1", "url": f"http://127.0.0.1:{free_port()}", "models": ["m1"]}
                    ],
                    "health_checks": {"enabled": False},
                }
            )
        )
        proc = Proc([ROUTER, "serve", "--config", str(path)], log_dir=tmp_path, name="router")
        try:
            deadline = time.monotonic() + 30
            while not _taken(admin):
                assert proc.alive(), proc.tail()
                assert time.monotonic() < deadline, "the admin port never took a connection"
                time.sleep(0.001)  # a poll interval: the admin port is tried every 1 ms
            assert _taken(port), "the admin port took a connection before the proxy's"
        finally:
            proc.stop()
