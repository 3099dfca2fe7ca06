"""`llmgw-agent run` as a real process: SIGTERM, engines outliving it, re-adoption."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from llmgw_agent.supervisor import process_start_ticks
from llmgw_proto import v1
from llmgw_testkit import Proc, free_port, wait_for_async

S = v1.ShardState


def agent_argv(config: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "llmgw_agent",
        "run",
        "--config",
        str(config),
        "--log-format",
        "json",
        *extra,
    ]


async def until(condition: Any, what: str, timeout: float = 60.0) -> Any:
    async def check() -> Any:
        return condition()

    return await wait_for_async(check, timeout=timeout, what=what)


async def wait_exit(proc: Proc, timeout: float = 60.0) -> int:
    return await asyncio.to_thread(proc.wait, timeout)


def write_config(tmp_path: Path, fake_engine: list[str], port: int, **extra: Any) -> Path:
    data: dict[str, Any] = {
        "node_id": "node-cli",
        "control": {"address": f"127.0.0.1:{port}"},
        "labels": {"fabric.nvlink-domain": "nvl-9", "fabric.ib-subnet": "ib-2"},
        "simulate_gpus": {"count": 2, "name": "NVIDIA H200", "memory": "141GiB"},
        "engine_host": "127.0.0.1",
        # The fake engine prints no help of its own.
        "engines": {"vllm": {"command": fake_engine, "flags_from": "captured:0.32.0"}},
        "state_dir": str(tmp_path / "state"),
        "stop_grace": "10s",
        "health_interval": "100ms",
        "base_backoff": "100ms",
        "max_backoff": "1s",
    }
    data.update(extra)
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


async def test_agent_restart_keeps_and_readopts_engine(
    kit: Any, control: Any, tmp_path: Path, fake_engine: list[str], reap: list[int]
) -> None:
    config = write_config(tmp_path, fake_engine, control.port)
    with Proc(agent_argv(config, "--insecure"), log_dir=tmp_path, name="agent1") as agent:
        [register] = await until(control.registers, "Register")
        assert register.labels == {"fabric.nvlink-domain": "nvl-9", "fabric.ib-subnet": "ib-2"}
        assert register.inventory.simulated
        assert len(register.inventory.gpus) == 2
        control.send(
            v1.ControlMessage(start_shard=kit.make_start(port=free_port(), gpu_indices=[1]))
        )
        ready = await until(lambda: [s for s in control.statuses() if s.state == S.READY], "READY")
        pid = ready[0].pid
        reap.append(pid)
        agent.signal(signal.SIGTERM)
        assert await wait_exit(agent) == 0
        assert "plaintext connection to the control plane" in agent.output()
    # The agent is gone (its process and group); the engine it launched is not.
    assert process_start_ticks(pid) is not None

    with Proc(agent_argv(config, "--insecure"), log_dir=tmp_path, name="agent2") as agent:
        registers = await until(
            lambda: len(control.registers()) >= 2 and control.registers(), "second Register"
        )
        [shard] = registers[1].shards
        assert (shard.shard_id, shard.pid, shard.state) == ("qwen.fast.0123abcd-0", pid, S.READY)
        # Supervised by the new agent: a stop through the control plane ends it.
        control.send(
            v1.ControlMessage(stop_shard=v1.StopShard(command_id="stop-1", shard_id=shard.shard_id))
        )
        stopped = await until(
            lambda: [s for s in control.statuses(1) if s.state == S.STOPPED], "STOPPED"
        )
        assert stopped[0].pid == pid
        await until(lambda: process_start_ticks(pid) is None, "engine to exit")
        agent.signal(signal.SIGTERM)
        assert await wait_exit(agent) == 0


async def test_stop_engines_on_exit(
    kit: Any, control: Any, tmp_path: Path, fake_engine: list[str], reap: list[int]
) -> None:
    config = write_config(
        tmp_path,
        fake_engine,
        control.port,
        stop_engines_on_exit=True,
        control={"address": f"127.0.0.1:{control.port}", "tls": {"insecure": True}},
    )
    with Proc(agent_argv(config), log_dir=tmp_path, name="agent") as agent:
        await until(control.registers, "Register")
        control.send(v1.ControlMessage(start_shard=kit.make_start(port=free_port())))
        ready = await until(lambda: [s for s in control.statuses() if s.state == S.READY], "READY")
        reap.append(ready[0].pid)
        agent.signal(signal.SIGTERM)
        assert await wait_exit(agent) == 0, agent.tail()
    assert process_start_ticks(ready[0].pid) is None
    # Sent before the agent exited; the control plane may read it a moment later.
    stopped = await until(
        lambda: [s for s in control.statuses() if s.state == S.STOPPED], "STOPPED"
    )
    assert "agent exiting" in stopped[0].reason


def test_run_config_errors_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "agent.yaml"
    bad.write_text("control: {address: 127.0.0.1:7070}\nstop_grace: forever\n")
    out = subprocess.run(agent_argv(bad), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert (
        out.stderr.strip()
        == f"error: {bad}: $.stop_grace: Expected a duration like `5s`, `500ms` or `2m`, got 'forever'"
    )
    # Without TLS files and without --insecure: refused, naming the field.
    plain = tmp_path / "plain.yaml"
    plain.write_text("control: {address: 127.0.0.1:7070}\n")
    out = subprocess.run(agent_argv(plain), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert (
        "$.control.tls.cert: required unless control.tls.insecure is true (or --insecure is given)"
        in out.stderr
    )
    # A certificate file that is not there: exit 2 naming the file, the field and the path,
    # without a traceback.
    (tmp_path / "n.crt").write_text("-")
    (tmp_path / "ca.crt").write_text("-")
    missing = tmp_path / "missing.yaml"
    missing.write_text(
        "control:\n  address: 127.0.0.1:7070\n"
        f"  tls: {{cert: {tmp_path}/n.crt, key: {tmp_path}/gone.key, ca: {tmp_path}/ca.crt}}\n"
    )
    out = subprocess.run(agent_argv(missing), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == (
        f"error: {missing}: $.control.tls.key: no such file: {tmp_path}/gone.key"
    )
    assert "Traceback" not in out.stderr


def test_logs_are_json_lines(tmp_path: Path, fake_engine: list[str]) -> None:
    # Nothing listens: the agent logs its reconnect attempts as JSON and exits on SIGTERM.
    config = write_config(tmp_path, fake_engine, free_port())
    with Proc(agent_argv(config, "--insecure"), log_dir=tmp_path, name="agent") as agent:
        agent.wait_output("reconnecting", timeout=60)
        agent.signal(signal.SIGTERM)
        assert agent.wait(timeout=60) == 0
        lines = [json.loads(line) for line in agent.output().splitlines() if line.startswith("{")]
    events = [line["event"] for line in lines]
    assert "stream to the control plane failed" in events
    assert "agent stopping" in events


@pytest.fixture(autouse=True)
def _no_stray_state(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir(exist_ok=True)
