"""The supervisor with real engine processes (a stand-in engine script)."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import re
import signal
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog.testing
from llmgw_agent.config import AgentConfig
from llmgw_agent.supervisor import Supervisor, cmdline_matches, live_records, process_start_ticks
from llmgw_proto import v1
from llmgw_testkit import free_port, wait_for_async

S = v1.ShardState
SIM_GPUS = dict.fromkeys(range(4), True)


class Recorder:
    """Collects the supervisor's status messages for a test to wait on."""

    def __init__(self) -> None:
        self.statuses: list[v1.ShardStatus] = []

    def __call__(self, status: v1.ShardStatus) -> None:
        self.statuses.append(status)

    def states(self, shard_id: str) -> list[v1.ShardState]:
        return [s.state for s in self.statuses if s.shard_id == shard_id]

    async def wait(
        self, shard_id: str, state: v1.ShardState, timeout: float = 30.0
    ) -> v1.ShardStatus:
        async def seen() -> v1.ShardStatus | None:
            for status in self.statuses:
                if status.shard_id == shard_id and status.state == state:
                    return status
            return None

        return await wait_for_async(
            seen, timeout=timeout, what=f"{shard_id} {state.name}: {self.statuses}"
        )


def make_supervisor(config: AgentConfig, recorder: Recorder) -> Supervisor:
    return Supervisor(config, gpus=SIM_GPUS, simulated=True, sink=recorder)


def alive(pid: int) -> bool:
    return process_start_ticks(pid) is not None


async def wait_dead(pid: int) -> None:
    async def dead() -> bool:
        return not alive(pid)

    await wait_for_async(dead, timeout=20, what=f"pid {pid} to exit")


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


async def test_start_ready_stop(
    kit: Any, make_config: Callable[..., AgentConfig], recorder: Recorder, reap: list[int]
) -> None:
    config = make_config()
    sup = make_supervisor(config, recorder)
    port = free_port()
    start = kit.make_start(port=port, gpu_indices=[1, 2], env={"SIM_LOAD": "0.5"})
    result = sup.start(start)
    assert result.ok
    assert result.command_id == "cmd-1"
    ready = await recorder.wait(start.shard_id, S.READY)
    assert recorder.states(start.shard_id) == [S.VALIDATING, S.STARTING, S.READY]
    starting = recorder.statuses[1]
    assert starting.pid > 0
    reap.append(starting.pid)
    assert ready.endpoint_url == f"http://127.0.0.1:{port}"
    assert ready.pid == starting.pid
    assert ready.replica_id == "qwen.fast.0123abcd"
    # The engine got the adapter's real command line and its GPUs.
    assert "fake engine argv: serve Qwen/Qwen2.5-0.5B-Instruct --host 127.0.0.1" in "\n".join(
        sup.engines[start.shard_id].output.lines
    )
    assert "CUDA_VISIBLE_DEVICES=1,2" in sup.output_tail(start.shard_id)
    # The shard is recorded for a restarted agent, and listed for Register.
    record = json.loads((Path(config.state_dir) / "shards" / f"{start.shard_id}.json").read_text())
    assert record["pid"] == starting.pid
    assert record["state"] == "READY"
    [running] = sup.running_shards()
    assert (running.shard_id, running.state, running.pid, running.port) == (
        start.shard_id,
        S.READY,
        starting.pid,
        port,
    )
    assert running.gpu_indices == [1, 2]
    # Idempotent: the same shard again launches nothing.
    again = sup.start(kit.make_start(port=port, gpu_indices=[1, 2], command_id="cmd-2"))
    assert again.ok
    assert "already runs" in again.error
    assert len(recorder.states(start.shard_id)) == 3

    stop = sup.stop(
        v1.StopShard(
            command_id="cmd-3", shard_id=start.shard_id, grace=datetime.timedelta(seconds=30)
        )
    )
    assert stop.ok
    stopped = await recorder.wait(start.shard_id, S.STOPPED)
    assert stopped.exit_code == 0  # the engine exits cleanly on SIGTERM
    assert "stopped on command" in stopped.reason
    await wait_dead(starting.pid)
    assert sup.engines == {}
    assert not (Path(config.state_dir) / "shards" / f"{start.shard_id}.json").exists()
    # Stopping it again is success, with a note.
    gone = sup.stop(v1.StopShard(command_id="cmd-4", shard_id=start.shard_id))
    assert gone.ok
    assert gone.error == f"shard {start.shard_id} is not running"


async def test_crash_reports_failed_with_exit_code_and_tail(
    kit: Any, make_config: Callable[..., AgentConfig], recorder: Recorder, reap: list[int]
) -> None:
    sup = make_supervisor(make_config(output_tail_lines=40), recorder)
    start = kit.make_start(port=free_port(), env={"SIM_EXIT_AFTER": "1", "SIM_EXIT": "3"})
    assert sup.start(start).ok
    reap.append(sup.engines[start.shard_id].pid)
    failed = await recorder.wait(start.shard_id, S.FAILED)
    assert failed.exit_code == 3
    assert failed.signal is None
    assert "engine exited by itself: exit code 3" in failed.reason
    lines = failed.output_tail.splitlines()
    assert len(lines) == 40
    assert lines[-1] == "dying line 59"
    assert sup.engines == {}
    # No restart by the agent: nothing else is launched.
    assert recorder.states(start.shard_id)[-1] == S.FAILED


async def test_the_tail_of_a_killed_engine_leaves_out_the_agents_own_polls(
    kit: Any, make_config: Callable[..., AgentConfig], recorder: Recorder, reap: list[int]
) -> None:
    # vLLM's uvicorn writes an access line for every health and metrics poll: a quiet
    # engine's tail would be nothing else within seconds.
    sup = make_supervisor(make_config(output_tail_lines=40, health_interval="0.05s"), recorder)
    start = kit.make_start(port=free_port(), env={"SIM_LOAD": "0.5", "SIM_ACCESS_LOG": "1"})
    assert sup.start(start).ok
    pid = sup.engines[start.shard_id].pid
    reap.append(pid)
    await recorder.wait(start.shard_id, S.READY)
    output = Path(sup.engines[start.shard_id].record.output_path)
    # The load poller's metrics scrapes, as the agent makes them once the engine is ready.
    async with aiohttp.ClientSession() as session:
        for _ in range(60):
            async with session.get(f"http://127.0.0.1:{start.port}/metrics") as response:
                assert response.status == 200
    scrapes = r'"GET /metrics HTTP/1\.[01]" 200'
    assert len(re.findall(scrapes, await asyncio.to_thread(output.read_text))) == 60
    os.kill(pid, signal.SIGKILL)
    failed = await recorder.wait(start.shard_id, S.FAILED)
    tail = failed.output_tail
    assert "listening on" in tail  # the engine's own lines, from before the polls
    assert re.search(r'"GET /health HTTP/1\.[01]" 503', tail)  # a poll that said something
    assert '" 200' not in tail
    assert re.search(scrapes, await asyncio.to_thread(output.read_text))  # the file keeps them


async def test_killed_engine_reports_signal(
    kit: Any, make_config: Callable[..., AgentConfig], recorder: Recorder, reap: list[int]
) -> None:
    sup = make_supervisor(make_config(), recorder)
    start = kit.make_start(port=free_port())
    assert sup.start(start).ok
    pid = sup.engines[start.shard_id].pid
    reap.append(pid)
    await recorder.wait(start.shard_id, S.READY)
    os.kill(pid, signal.SIGKILL)
    failed = await recorder.wait(start.shard_id, S.FAILED)
    assert failed.signal == signal.SIGKILL
    assert failed.exit_code is None
    assert "killed by SIGKILL" in failed.reason


async def test_validation_refusal_launches_nothing(
    kit: Any, make_config: Callable[..., AgentConfig], recorder: Recorder
) -> None:
    config = make_config()
    sup = make_supervisor(config, recorder)
    start = kit.make_start(port=free_port(), engine_args=["--no-such-flag"], gpu_indices=[9])
    result = sup.start(start)
    assert not result.ok
    assert "unknown engine argument '--no-such-flag'" in result.error
    assert "GPU 9 does not exist" in result.error
    assert recorder.states(start.shard_id) == [S.VALIDATING, S.FAILED]
    assert recorder.statuses[-1].reason == result.error
    assert sup.engines == {}
    assert not (Path(config.state_dir) / "shards").exists() or not list(
        (Path(config.state_dir) / "shards").iterdir()
    )


async def test_gpus_and_port_of_a_running_shard_are_refused(
    kit: Any, make_config: Callable[..., AgentConfig], recorder: Recorder, reap: list[int]
) -> None:
    sup = make_supervisor(make_config(), recorder)
    first = kit.make_start(port=free_port(), gpu_indices=[0])
    assert sup.start(first).ok
    reap.append(sup.engines[first.shard_id].pid)
    second = kit.make_start(shard_id="other-0", port=first.port, gpu_indices=[0])
    result = sup.start(second)
    assert not result.ok
    assert f"port {first.port} is used by shard {first.shard_id}" in result.error
    assert f"GPU 0 is used by shard {first.shard_id}" in result.error
    await sup.close(stop_engines=True)
    await recorder.wait(first.shard_id, S.STOPPED)


async def test_load_timeout_fails_and_kills(
    kit: Any, make_config: Callable[..., AgentConfig], recorder: Recorder, reap: list[int]
) -> None:
    sup = make_supervisor(make_config(), recorder)
    start = kit.make_start(
        port=free_port(), env={"SIM_LOAD": "600"}, load_timeout=datetime.timedelta(seconds=1)
    )
    assert sup.start(start).ok
    pid = sup.engines[start.shard_id].pid
    reap.append(pid)
    failed = await recorder.wait(start.shard_id, S.FAILED)
    assert "not ready within the load timeout of 1s (last health check: 503)" in failed.reason
    assert S.READY not in recorder.states(start.shard_id)
    await wait_dead(pid)


async def test_stop_escalates_to_sigkill(
    kit: Any, make_config: Callable[..., AgentConfig], recorder: Recorder, reap: list[int]
) -> None:
    sup = make_supervisor(make_config(), recorder)
    start = kit.make_start(port=free_port(), env={"SIM_IGNORE_TERM": "1"})
    assert sup.start(start).ok
    pid = sup.engines[start.shard_id].pid
    reap.append(pid)
    await recorder.wait(start.shard_id, S.READY)
    sup.stop(
        v1.StopShard(command_id="c", shard_id=start.shard_id, grace=datetime.timedelta(seconds=0.5))
    )
    stopped = await recorder.wait(start.shard_id, S.STOPPED)
    assert stopped.signal == signal.SIGKILL
    assert (
        "ignoring SIGTERM" in sup.output_tail(start.shard_id)
        or "killed by SIGKILL" in stopped.reason
    )


async def test_drain_waits_for_running_requests(
    kit: Any,
    make_config: Callable[..., AgentConfig],
    recorder: Recorder,
    reap: list[int],
    tmp_path: Path,
) -> None:
    sup = make_supervisor(make_config(), recorder)
    running = tmp_path / "running"
    running.write_text("2")
    start = kit.make_start(port=free_port(), env={"SIM_RUNNING_FILE": str(running)})
    assert sup.start(start).ok
    reap.append(sup.engines[start.shard_id].pid)
    await recorder.wait(start.shard_id, S.READY)
    deadline = datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=5)
    assert sup.drain(v1.DrainShard(command_id="d", shard_id=start.shard_id, deadline=deadline)).ok
    await recorder.wait(start.shard_id, S.DRAINING)
    [listed] = sup.running_shards()
    assert listed.state == S.DRAINING
    # Two requests still running: the engine stays up while the metric says so.
    assert start.shard_id in sup.engines
    assert S.STOPPED not in recorder.states(start.shard_id)
    running.write_text("0")
    stopped = await recorder.wait(start.shard_id, S.STOPPED)
    assert stopped.reason.startswith("drained (")
    assert recorder.states(start.shard_id) == [
        S.VALIDATING,
        S.STARTING,
        S.READY,
        S.DRAINING,
        S.STOPPED,
    ]


async def test_drain_deadline_passes(
    kit: Any,
    make_config: Callable[..., AgentConfig],
    recorder: Recorder,
    reap: list[int],
    tmp_path: Path,
) -> None:
    sup = make_supervisor(make_config(), recorder)
    running = tmp_path / "running"
    running.write_text("5")
    start = kit.make_start(port=free_port(), env={"SIM_RUNNING_FILE": str(running)})
    assert sup.start(start).ok
    reap.append(sup.engines[start.shard_id].pid)
    await recorder.wait(start.shard_id, S.READY)
    deadline = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=1)
    sup.drain(v1.DrainShard(command_id="d", shard_id=start.shard_id, deadline=deadline))
    stopped = await recorder.wait(start.shard_id, S.STOPPED)
    assert "deadline passed with 5 requests running" in stopped.reason


async def test_restarted_agent_readopts_live_engine(
    kit: Any, make_config: Callable[..., AgentConfig], reap: list[int]
) -> None:
    config = make_config()
    first_statuses = Recorder()
    first = make_supervisor(config, first_statuses)
    start = kit.make_start(port=free_port(), env={"SIM_LOAD": "0.2"})
    assert first.start(start).ok
    pid = first.engines[start.shard_id].pid
    reap.append(pid)
    ready = await first_statuses.wait(start.shard_id, S.READY)
    secret = ready.api_key  # the engine's, given at launch (issue 24.3)
    assert len(secret) >= 32
    # The agent goes away (an upgrade): the engine keeps running.
    await first.close(stop_engines=False)
    assert alive(pid)
    assert [r.pid for r in live_records(Path(config.state_dir))] == [pid]

    statuses = Recorder()
    second = make_supervisor(config, statuses)
    assert second.adopt() == [start.shard_id]
    [running] = second.running_shards()
    assert (running.pid, running.state, running.port) == (pid, S.READY, start.port)
    assert running.endpoint_url == f"http://127.0.0.1:{start.port}"
    # It keeps its secret (from the record): Register reports it, the polls send it.
    assert running.api_key == secret
    assert [source.api_key for source in second.load_sources()] == [secret]
    # It still holds its GPUs and port against new shards.
    refused = second.start(kit.make_start(shard_id="x-0", port=start.port, gpu_indices=[0]))
    assert not refused.ok
    # Its earlier output is back in the ring buffer, from the engine's output file.
    assert "listening on" in second.output_tail(start.shard_id)
    # Supervised by pid: its death is still noticed and reported.
    os.kill(pid, signal.SIGKILL)
    failed = await statuses.wait(start.shard_id, S.FAILED)
    assert "exit code unknown" in failed.reason
    assert second.running_shards() == []


async def test_readopted_starting_engine_resumes_health_polling(
    kit: Any, make_config: Callable[..., AgentConfig], reap: list[int]
) -> None:
    config = make_config()
    first = make_supervisor(config, Recorder())
    start = kit.make_start(port=free_port(), env={"SIM_LOAD": "2"})
    assert first.start(start).ok
    reap.append(first.engines[start.shard_id].pid)
    await first.close(stop_engines=False)
    statuses = Recorder()
    second = make_supervisor(config, statuses)
    assert second.adopt() == [start.shard_id]
    assert second.running_shards()[0].state == S.STARTING
    ready = await statuses.wait(start.shard_id, S.READY)
    assert ready.endpoint_url.endswith(f":{start.port}")
    await second.close(stop_engines=True)
    await statuses.wait(start.shard_id, S.STOPPED)


async def test_dead_recorded_engine_is_reported_not_adopted(
    kit: Any, make_config: Callable[..., AgentConfig], reap: list[int]
) -> None:
    config = make_config()
    first_statuses = Recorder()
    first = make_supervisor(config, first_statuses)
    start = kit.make_start(port=free_port())
    assert first.start(start).ok
    pid = first.engines[start.shard_id].pid
    reap.append(pid)
    await first_statuses.wait(start.shard_id, S.READY)
    await first.close(stop_engines=False)
    os.killpg(pid, signal.SIGKILL)
    await wait_dead(pid)
    statuses = Recorder()
    second = make_supervisor(config, statuses)
    assert second.adopt() == []
    [failed] = statuses.statuses
    assert failed.state == S.FAILED
    assert "exited while no agent was watching it" in failed.reason
    assert "listening on" in failed.output_tail
    assert list((Path(config.state_dir) / "shards").glob("*.json")) == []


def test_cmdline_matches() -> None:
    argv = ["llmgw-sim", "vllm", "serve", "m", "--port", "1"]
    assert cmdline_matches(argv, argv)
    # A #! script runs as: interpreter /path/to/script args...
    assert cmdline_matches(
        argv, ["/venv/bin/python3", "/venv/bin/llmgw-sim", "vllm", "serve", "m", "--port", "1"]
    )
    assert not cmdline_matches(
        argv, ["/venv/bin/python3", "/venv/bin/other", "vllm", "serve", "m", "--port", "1"]
    )
    assert not cmdline_matches(argv, ["llmgw-sim", "vllm", "serve", "m", "--port", "2"])
    assert not cmdline_matches(argv, [])


def test_process_start_ticks() -> None:
    assert process_start_ticks(os.getpid()) is not None
    assert process_start_ticks(2**22 + 12345) is None


async def test_drain_of_a_loading_engine_stops_it_at_once(
    kit: Any, make_config: Callable[..., AgentConfig], recorder: Recorder, reap: list[int]
) -> None:
    sup = make_supervisor(make_config(), recorder)
    start = kit.make_start(port=free_port(), env={"SIM_LOAD": "600"})
    assert sup.start(start).ok
    reap.append(sup.engines[start.shard_id].pid)
    deadline = datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=10)
    sup.drain(v1.DrainShard(command_id="d", shard_id=start.shard_id, deadline=deadline))
    stopped = await recorder.wait(start.shard_id, S.STOPPED)
    assert stopped.reason.startswith("drained (")
    assert recorder.states(start.shard_id) == [S.VALIDATING, S.STARTING, S.DRAINING, S.STOPPED]


async def test_an_engine_unreachable_at_its_endpoint_is_said_loudly(
    kit: Any, make_config: Callable[..., AgentConfig], recorder: Recorder, reap: list[int]
) -> None:
    # The engine binds loopback while the node advertises another address: nobody else
    # could reach it there. It still runs, but READY says so.
    sup = make_supervisor(make_config(advertise_host="10.0.0.5"), recorder)
    port = free_port()
    start = kit.make_start(port=port)
    assert sup.start(start).ok
    ready = await recorder.wait(start.shard_id, S.READY)
    reap.append(ready.pid)
    assert ready.endpoint_url == f"http://10.0.0.5:{port}"
    assert "WARNING: the engine binds 127.0.0.1 (loopback) but is advertised at 10.0.0.5" in (
        ready.reason
    )
    sup.stop(v1.StopShard(command_id="s", shard_id=start.shard_id))
    await recorder.wait(start.shard_id, S.STOPPED)


async def test_engine_logs_and_records_are_private(
    kit: Any, make_config: Callable[..., AgentConfig], recorder: Recorder, reap: list[int]
) -> None:
    # Issue 24: records (the profile's env, tokens) and engine logs were 0644 in 0755
    # directories. A log and directory an older agent left open are tightened too.
    config = make_config()
    state = Path(config.state_dir)
    start = kit.make_start(port=free_port(), env={"HF_TOKEN": "hf_secret"})
    (state / "logs").mkdir(parents=True, mode=0o755)
    os.chmod(state / "logs", 0o755)
    old_log = state / "logs" / f"{start.shard_id}.log"
    old_log.write_text("an older engine's output\n")
    os.chmod(old_log, 0o644)
    sup = make_supervisor(config, recorder)
    assert sup.start(start).ok
    reap.append(sup.engines[start.shard_id].pid)
    await recorder.wait(start.shard_id, S.READY)
    record = state / "shards" / f"{start.shard_id}.json"
    assert "hf_secret" in record.read_text()
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in (state / "shards", state / "logs")}
    assert modes == {state / "shards": 0o700, state / "logs": 0o700}
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    assert stat.S_IMODE(old_log.stat().st_mode) == 0o600
    await sup.close(stop_engines=True)


async def test_a_torn_record_does_not_orphan_its_live_engine(
    kit: Any, make_config: Callable[..., AgentConfig], reap: list[int]
) -> None:
    # Issue 24: with the agent stopped, a record cut in half made the restarted agent
    # forget the engine, which kept its port: every retry was "port ... is not free".
    config = make_config()
    first_statuses = Recorder()
    first = make_supervisor(config, first_statuses)
    start = kit.make_start(port=free_port(), gpu_indices=[1])
    assert first.start(start).ok
    pid = first.engines[start.shard_id].pid
    reap.append(pid)
    await first_statuses.wait(start.shard_id, S.READY)
    await first.close(stop_engines=False)
    record = Path(config.state_dir) / "shards" / f"{start.shard_id}.json"
    whole = record.read_bytes()
    record.write_bytes(whole[: len(whole) // 2])

    statuses = Recorder()
    second = make_supervisor(config, statuses)
    with structlog.testing.capture_logs() as logs:
        assert second.adopt() == []
    assert any(e.get("path") == str(record) and "torn" in e["event"] for e in logs)
    assert not record.exists()
    # Found by its mark: being stopped, and until it is gone its port and GPU stay taken.
    assert [m.pid for members in second.strays.values() for m in members] == [pid]
    held = second.start(kit.make_start(shard_id="x-0", port=start.port, gpu_indices=[1]))
    assert not held.ok
    assert f"port {start.port} is used by shard {start.shard_id} (a stray" in held.error
    assert "GPU 1 is used by shard" in held.error
    assert statuses.statuses[-1].ports_taken == []  # an engine of ours, not a stranger
    await second.stop_strays()
    assert not alive(pid)
    assert second.strays == {}
    # The same shard again, on the same port and GPU: launched, and it becomes ready.
    assert second.start(start).ok
    reap.append(second.engines[start.shard_id].pid)
    await statuses.wait(start.shard_id, S.READY)
    await second.close(stop_engines=True)


async def test_a_port_held_by_another_program_is_named_in_the_refusal(
    kit: Any, make_config: Callable[..., AgentConfig], recorder: Recorder
) -> None:
    sup = make_supervisor(make_config(), recorder)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        start = kit.make_start(port=port)
        result = sup.start(start)
    assert not result.ok
    assert f"port {port} is not free" in result.error
    failed = await recorder.wait(start.shard_id, S.FAILED)
    assert failed.ports_taken == [port]
    # Refused for another reason, with a free port: no port is named.
    other = kit.make_start(shard_id="y-0", port=free_port(), gpu_indices=[9])
    assert not sup.start(other).ok
    assert (await recorder.wait("y-0", S.FAILED)).ports_taken == []


async def test_kv_events_go_to_a_unix_socket_of_the_agents(
    kit: Any, make_config: Callable[..., AgentConfig], reap: list[int]
) -> None:
    """Issue 24.3: not tcp://* (every address of the node), whatever the profile said."""
    config = make_config()
    recorder = Recorder()
    sup = make_supervisor(config, recorder)
    kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0"}
    start = kit.make_start(port=free_port(), engine_args=["--kv-events-config", json.dumps(kv)])
    assert sup.start(start).ok
    engine = sup.engines[start.shard_id]
    reap.append(engine.pid)
    launch = engine.record.launch
    endpoint = json.loads(launch.argv[launch.argv.index("--kv-events-config") + 1])["endpoint"]
    assert endpoint == launch.kv_events_endpoint
    assert endpoint.startswith("ipc://")
    where = Path(endpoint[len("ipc://") :]).parent
    assert stat.S_IMODE(where.stat().st_mode) == 0o700
    await sup.close(stop_engines=True)
