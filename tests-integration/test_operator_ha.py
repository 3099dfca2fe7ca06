"""Issue 29.1: the operator's overrides survive a failover (two control planes on etcd).

A cordon and a scale made on the leader are in the store; the standby refuses changes
(send them to the leader); after the leader is SIGKILLed the new one shows both and
keeps to them: nothing more is started on the cordoned node, the count stays the
override's, not the config's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from llmgw_testkit import Proc, free_port, wait_for
from llmgw_testkit.cluster import Cluster, bin_path, metric_sum, vllm_profile
from llmgw_testkit.servers import Etcd

MODELS = [{"name": "chat", "profiles": {"default": vllm_profile(gpus=1, replicas=2)}}]


@pytest.fixture
def etcd(cluster: Cluster) -> Iterator[Etcd]:
    server = Etcd(cluster.workdir / "etcd")
    try:
        yield server
    finally:
        server.stop()


def start(cluster: Cluster, name: str, etcd: Etcd) -> tuple[Proc, int, int]:
    grpc, admin = free_port(), free_port()
    config = cluster.control_config(MODELS)
    config["listen"] = f"127.0.0.1:{grpc}"
    config["admin_listen"] = f"127.0.0.1:{admin}"
    config["state"] = {
        "backend": "etcd",
        "etcd": {"endpoints": [etcd.endpoint], "timeout": "2s"},
        # One admin token for both instances (the default <state_dir>/admin.token).
        "state_dir": str(cluster.workdir / "control-state"),
    }
    config["ha"] = {"backend": "etcd", "instance_id": name, "advertise": f"127.0.0.1:{grpc}",
                    "lease_ttl": "3s"}  # fmt: skip
    path = cluster.write(f"control-{name}.yaml", config)
    argv = [bin_path("llmgw-control"), "serve", "--config", str(path), "--log-format", "json"]
    proc = cluster._start(f"control-{name}", argv)
    cluster.control_addresses.append(f"127.0.0.1:{grpc}")
    return proc, grpc, admin


def leads(admin: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=5) as resp:
            return metric_sum(resp.read().decode(), "llmgw_control_leader") == 1
    except OSError:
        return False


def ctl(cluster: Cluster, admin: int, *args: str) -> Any:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_ADMIN")}
    env["LLMGW_ADMIN"] = f"127.0.0.1:{admin}"
    env["LLMGW_ADMIN_TOKEN_FILE"] = str(cluster.workdir / "control-state" / "admin.token")
    return subprocess.run(
        [bin_path("llmgw-control"), *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_overrides_survive_a_failover(cluster: Cluster, etcd: Etcd) -> None:
    cluster.timings.update(unreachable_after="2s", lost_after="60s", startup_grace="1s")
    a, _, a_admin = start(cluster, "a", etcd)
    wait_for(lambda: leads(a_admin), timeout=60, what="a leads")
    _, _, b_admin = start(cluster, "b", etcd)
    wait_for(lambda: ctl(cluster, b_admin, "status").returncode == 0, timeout=60, what="b up")
    cluster.admin_port = a_admin
    # gpu-a has room for all three whichever node the first two landed on.
    cluster.start_agent("gpu-a", gpus=3)
    cluster.start_agent("gpu-b", gpus=2)
    cluster.wait_replicas("chat", 2, timeout=120)
    # Both replicas may be ready on gpu-a before gpu-b has registered.
    cluster.wait_node_state("gpu-b", "READY", timeout=60)

    assert ctl(cluster, a_admin, "node", "cordon", "gpu-b").returncode == 0
    assert ctl(cluster, a_admin, "scale", "chat", "3").returncode == 0
    wait_for(
        lambda: len([r for r in cluster.replicas("chat") if r["state"] == "ready"]) == 3,
        timeout=120,
        what="three ready under a",
    )
    standby = ctl(cluster, b_admin, "node", "uncordon", "gpu-b")
    assert standby.returncode == 1
    assert "stands by" in standby.stderr

    a.signal(signal.SIGKILL)
    wait_for(lambda: leads(b_admin), timeout=60, what="b leads")
    cluster.admin_port = b_admin
    status = wait_for(
        lambda: (s := cluster.status())["operations"]["scales"] and s,
        timeout=30,
        what="the overrides under b",
    )
    assert [n["node_id"] for n in status["operations"]["nodes"]] == ["gpu-b"]
    assert [s["replicas"] for s in status["operations"]["scales"]] == [3]
    wait_for(
        lambda: {n["state"] for n in cluster.status()["nodes"]} == {"READY"},
        timeout=90,
        what="both nodes READY under b",
    )
    ticks = cluster.status()["reconciles"]
    wait_for(lambda: cluster.status()["reconciles"] >= ticks + 25, timeout=60, what="ticks")
    replicas = cluster.replicas("chat")
    assert len(replicas) == 3
    assert all(r["state"] == "ready" for r in replicas)
    # b's own change goes through now that it leads.
    assert ctl(cluster, b_admin, "node", "uncordon", "gpu-b").returncode == 0
