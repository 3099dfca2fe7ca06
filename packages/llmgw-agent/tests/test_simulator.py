"""The real adapters launching the engine simulator (llmgw-sim) under the supervisor."""

from __future__ import annotations

import asyncio
import datetime
import json
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from llmgw_agent.config import AgentConfig
from llmgw_agent.health import running_requests
from llmgw_agent.load import LoadReporter
from llmgw_agent.supervisor import Supervisor
from llmgw_proto import v1
from llmgw_testkit import free_port, http_get, wait_for_async

S = v1.ShardState
SIM = Path(sys.executable).parent / "llmgw-sim"

pytestmark = pytest.mark.skipif(not SIM.exists(), reason="llmgw-sim is not installed")

ENGINES = {
    "vllm": (v1.EngineKind.VLLM, [str(SIM), "vllm"], "Qwen/Qwen2.5-0.5B-Instruct"),
    "sglang": (v1.EngineKind.SGLANG, [str(SIM), "sglang"], "Qwen/Qwen2.5-0.5B-Instruct"),
    "llamacpp": (v1.EngineKind.LLAMACPP, [str(SIM), "llama-server"], "/models/qwen.gguf"),
}


class Statuses(list[v1.ShardStatus]):
    async def wait(self, state: v1.ShardState, timeout: float = 60.0) -> v1.ShardStatus:
        async def seen() -> v1.ShardStatus | None:
            return next((s for s in self if s.state == state), None)

        return await wait_for_async(seen, timeout=timeout, what=f"{state.name} in {self}")


def sim_supervisor(make_config: Callable[..., AgentConfig], statuses: Statuses) -> Supervisor:
    # The simulator accepts the captured real engines' flags; SGLang's are read from the
    # simulator's own --help until SGLang's capture lands.
    flags = {"vllm": "captured:0.32.0", "sglang": "", "llamacpp": "captured:b11434"}
    config = make_config(
        engines={k: {"command": cmd, "flags_from": flags[k]} for k, (_, cmd, _) in ENGINES.items()}
    )
    sup = Supervisor(
        config, gpus=dict.fromkeys(range(4), True), simulated=True, sink=statuses.append
    )
    # The GGUF path is the simulator's business: it loads nothing from disk.
    sup.probes = type(sup.probes)(sup.probes.which, sup.probes.port_free, lambda p: True)
    return sup


def sim_start(kit: Any, engine: str, **extra: Any) -> v1.StartShard:
    kind, _, model_ref = ENGINES[engine]
    gpus = [] if engine == "llamacpp" else [0, 1]
    fields: dict[str, Any] = {
        "engine": kind, "model_ref": model_ref, "gpu_indices": gpus, "port": free_port(),
        "env": {"LLMGW_SIM_LOAD_TIME": "0.5"},
    }  # fmt: skip
    fields.update(extra)
    return kit.make_start(**fields)  # type: ignore[no-any-return]


@pytest.mark.parametrize("engine", sorted(ENGINES))
async def test_simulated_engine_ready_then_stopped(
    kit: Any, make_config: Callable[..., AgentConfig], reap: list[int], engine: str
) -> None:
    statuses = Statuses()
    sup = sim_supervisor(make_config, statuses)
    start = sim_start(kit, engine)
    result = sup.start(start)
    assert result.ok, result.error
    reap.append(sup.engines[start.shard_id].pid)
    ready = await statuses.wait(S.READY)
    # The engine answers the OpenAI API at the URL the agent reports, to whoever has the
    # secret the agent reported with READY (the router), and to nobody else.
    assert len(ready.api_key) >= 32
    # (llama-server leaves /v1/models open and guards /metrics.)
    guarded = ready.endpoint_url + ("/metrics" if engine == "llamacpp" else "/v1/models")
    status, _ = await asyncio.to_thread(http_get, guarded, 10.0)
    assert status == 401
    url = ready.endpoint_url + "/v1/models"
    status, body = await asyncio.to_thread(_get_with_key, url, ready.api_key)
    assert status == 200
    models = json.loads(body)
    assert "qwen" in [m["id"] for m in models["data"]]
    # The agent reads the simulator's metrics under the real engine's own names.
    reporter = LoadReporter(
        sup.load_sources, lambda report: None, interval=lambda: 0.25, session=lambda: 1
    )
    report = await reporter.round()
    assert report is not None
    [load] = report.engines
    assert load.shard_id == start.shard_id
    assert load.known
    assert (load.running, load.waiting) == (0, 0)
    # A generous grace: under load a clean exit may take a while, and SIGKILL would show.
    sup.stop(
        v1.StopShard(command_id="s", shard_id=start.shard_id, grace=datetime.timedelta(seconds=30))
    )
    stopped = await statuses.wait(S.STOPPED)
    assert stopped.signal is None
    assert [s.state for s in statuses] == [S.VALIDATING, S.STARTING, S.READY, S.STOPPED]


def _get_with_key(url: str, api_key: str) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return int(response.status), response.read()


def _slow_completion(url: str, api_key: str) -> int:
    body = json.dumps({"model": "qwen", "prompt": "hi", "max_tokens": 30}).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"}
    request = urllib.request.Request(url + "/v1/completions", data=body, headers=headers)
    with urllib.request.urlopen(request, timeout=60) as response:
        return int(response.status)


async def test_drain_waits_for_a_request_in_flight(
    kit: Any, make_config: Callable[..., AgentConfig], reap: list[int]
) -> None:
    statuses = Statuses()
    sup = sim_supervisor(make_config, statuses)
    env = {"LLMGW_SIM_LOAD_TIME": "0.2", "LLMGW_SIM_ITL": "0.1", "LLMGW_SIM_OUTPUT_LEN": "30"}
    start = sim_start(kit, "vllm", env=env)
    assert sup.start(start).ok
    reap.append(sup.engines[start.shard_id].pid)
    ready = await statuses.wait(S.READY)
    request = asyncio.create_task(
        asyncio.to_thread(_slow_completion, ready.endpoint_url, ready.api_key)
    )
    engine = sup.engines[start.shard_id]

    async def busy() -> bool:
        launch = engine.record.launch
        return bool(await running_requests(launch.metrics_url, engine.adapter.running_metric))

    await wait_for_async(busy, timeout=30, what="a running request in the engine's metrics")
    # The load report sees it too (under the same real metric name).
    reporter = LoadReporter(
        sup.load_sources, lambda report: None, interval=lambda: 0.25, session=lambda: 1
    )
    report = await reporter.round()
    assert report is not None
    assert report.engines[0].known
    deadline = datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=2)
    sup.drain(v1.DrainShard(command_id="d", shard_id=start.shard_id, deadline=deadline))
    await statuses.wait(S.DRAINING)
    # The request finishes (200), and only then is the engine stopped.
    assert await request == 200
    stopped = await statuses.wait(S.STOPPED)
    assert stopped.reason.startswith("drained (")


async def test_simulated_crash_and_load_failure_carry_the_output_tail(
    kit: Any, make_config: Callable[..., AgentConfig], reap: list[int]
) -> None:
    statuses = Statuses()
    sup = sim_supervisor(make_config, statuses)
    crash_env = {
        "LLMGW_SIM_LOAD_TIME": "0.2",
        "LLMGW_SIM_CRASH_AFTER_SECONDS": "0.5",
        "LLMGW_SIM_CRASH_MESSAGE": "NCCL error: unhandled system error",
        "LLMGW_SIM_EXIT_CODE": "3",
    }
    crash = sim_start(kit, "vllm", env=crash_env)
    assert sup.start(crash).ok
    reap.append(sup.engines[crash.shard_id].pid)
    failed = await statuses.wait(S.FAILED)
    assert failed.exit_code == 3
    assert "NCCL error: unhandled system error" in failed.output_tail
    assert [s.state for s in statuses] == [S.VALIDATING, S.STARTING, S.READY, S.FAILED]

    statuses.clear()
    oom = sim_start(
        kit, "sglang", shard_id="oom-0",
        env={"LLMGW_SIM_FAIL_ON_LOAD": "CUDA out of memory", "LLMGW_SIM_EXIT_CODE": "1"},
    )  # fmt: skip
    assert sup.start(oom).ok
    reap.append(sup.engines[oom.shard_id].pid)
    failed = await statuses.wait(S.FAILED)
    assert failed.exit_code == 1
    assert "CUDA out of memory" in failed.output_tail
    assert S.READY not in [s.state for s in statuses]
