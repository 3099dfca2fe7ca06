"""Issue 24, points 9 and 10, with real processes: an engine whose record was torn while
its agent was down is found by its mark and stopped, and a port of the range held by
another program on the node sends the replica to another port instead of failing it
forever."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from pathlib import Path
from typing import Any

from llmgw_testkit import wait_for
from llmgw_testkit.cluster import Cluster, vllm_profile


def the_replica(cluster: Cluster) -> dict[str, Any] | None:
    replicas = cluster.replicas("chat")
    return replicas[0] if len(replicas) == 1 else None


def ready(cluster: Cluster) -> dict[str, Any] | None:
    replica = the_replica(cluster)
    return replica if replica is not None and replica["state"] == "ready" else None


def gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2 :].split()[0] in ("Z", "X")


def test_a_torn_record_does_not_orphan_the_engine(cluster: Cluster) -> None:
    cluster.start_control([{"name": "chat", "profiles": {"p": vllm_profile(gpus=1)}}])
    cluster.start_agent("gpu-a", gpus=1)
    wait_for(lambda: ready(cluster), timeout=120, what="the replica ready")
    [pid] = cluster.engine_pids()
    try:
        # The agent goes away (engines keep running); a crash tore the record.
        cluster.agents["gpu-a"].stop()
        assert not gone(pid)
        [record] = (cluster.state_dir("gpu-a") / "shards").glob("*.json")
        whole = record.read_bytes()
        record.write_bytes(whole[: len(whole) // 2])

        agent = cluster.start_agent("gpu-a", gpus=1)
        # The engine no record names is found by its mark and stopped, then the shard is
        # started again on its port: ready, no "port ... is not free" loop.
        wait_for(lambda: gone(pid), timeout=120, what=f"the stray engine {pid} stopped")
        again = wait_for(
            lambda: (r := ready(cluster)) is not None and r["shards"][0]["pid"] != pid and r,
            timeout=120,
            what="the replica ready again with a new engine",
        )
        # The same replica on its port, or (the node was LOST while the agent was away)
        # a replacement; either way never refused for a port the stray held.
        assert "not free" not in again["last_error"], again["last_error"]
        log = agent.output()
        assert str(record) in log
        assert "removing unreadable shard record (torn or corrupt)" in log
        assert "stopping an engine no record names" in log
        assert "not free" not in log
        # Records and logs are the owner's only.
        assert (cluster.state_dir("gpu-a") / "shards").stat().st_mode & 0o777 == 0o700
        for path in (cluster.state_dir("gpu-a") / "shards").glob("*.json"):
            assert path.stat().st_mode & 0o777 == 0o600
        for path in (cluster.state_dir("gpu-a") / "logs").glob("*.log"):
            assert path.stat().st_mode & 0o777 == 0o600
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def test_a_port_held_by_another_program_moves_the_replica(cluster: Cluster) -> None:
    low = int(cluster.timings["port_range"][0])
    with socket.socket() as holder:
        # Something else on the node holds the first port of the range (a connection
        # of an earlier test's engine may linger on it in TIME_WAIT).
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", low))
        holder.listen()
        cluster.start_control([{"name": "chat", "profiles": {"p": vllm_profile(gpus=1)}}])
        agent = cluster.start_agent("gpu-a", gpus=1)
        replica = wait_for(lambda: ready(cluster), timeout=120, what="the replica ready")
        [shard] = replica["shards"]
        assert shard["port"] != low
        # Refused once on the held port, then placed elsewhere: not the same port again.
        refusals = [line for line in agent.output().splitlines() if "refused shard" in line]
        assert len(refusals) == 1, refusals
        assert f"port {low} is not free" in refusals[0]
