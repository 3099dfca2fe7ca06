"""Issue 24: no engine's API key in its command line (``ps``, /proc/PID/cmdline).

vLLM and llama-server read the key from their environment; SGLang reads no such
variable, but reads options from the YAML file its ``--config`` names (0.5.23's help:
"Read CLI options from a config file. Must be a YAML file"): the agent writes the key
there, owner only, next to the shard's record. Checked on the simulator, launched by
the real adapters under the supervisor, which parses ``--config`` as SGLang does.
"""

from __future__ import annotations

import asyncio
import datetime
import stat
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from llmgw_agent.adapters import SGLANG, api_key_options, build_launch, with_api_key
from llmgw_agent.config import AgentConfig
from llmgw_agent.engine_flags import captured
from llmgw_agent.supervisor import Supervisor
from llmgw_proto import v1
from llmgw_testkit import free_port, wait_for_async

S = v1.ShardState
SIM = Path(sys.executable).parent / "llmgw-sim"
KEY = "s3cr3t-key"

ENGINES = {
    "vllm": (v1.EngineKind.VLLM, [str(SIM), "vllm"], "Qwen/Qwen2.5-0.5B-Instruct", [0]),
    "sglang": (v1.EngineKind.SGLANG, [str(SIM), "sglang"], "Qwen/Qwen2.5-0.5B-Instruct", [0]),
    "llamacpp": (v1.EngineKind.LLAMACPP, [str(SIM), "llama-server"], "/models/q.gguf", []),
}


def _sglang_launch(kit: Any, *engine_args: str) -> Any:
    start = kit.make_start(engine=v1.EngineKind.SGLANG, engine_args=list(engine_args))
    parsed = captured("sglang", "0.5.23").parse(start.engine_args)
    return build_launch(
        SGLANG, start, parsed, ["engine"], bind_host="10.0.0.5", endpoint_host="10.0.0.5"
    )


def test_sglang_gets_the_key_in_its_options_file(kit: Any) -> None:
    base = _sglang_launch(kit)
    keyed = with_api_key(SGLANG, base, KEY, "/state/shards/s.options.yaml")
    assert keyed.argv == [*base.argv, "--config", "/state/shards/s.options.yaml"]
    assert keyed.api_key == KEY
    assert keyed.api_key_file == "/state/shards/s.options.yaml"
    assert KEY not in " ".join(keyed.argv)


def test_a_profile_with_its_own_options_file_keeps_the_key_in_argv(kit: Any) -> None:
    # SGLang takes one --config only; the profile's is kept, the key goes to argv.
    base = _sglang_launch(kit, "--config", "/etc/sglang.yaml")
    keyed = with_api_key(SGLANG, base, KEY, "/state/shards/s.options.yaml")
    assert keyed.argv == [*base.argv, "--api-key", KEY]
    assert keyed.api_key_file == ""


@given(st.text(min_size=1, max_size=64))
def test_the_options_file_reads_back_as_the_key(key: str) -> None:
    assert yaml.safe_load(api_key_options(key)) == {"api-key": key}


def _check_not_in_cmdline(pid: int, key: str, options: str | None) -> None:
    """``key`` is nowhere in the engine's argv; with ``options``, that file (owner only)
    holds it and argv names it after ``--config``; without, the launch has no file."""
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    assert key.encode() not in cmdline
    if options is None:
        return
    args = cmdline.split(b"\0")
    assert args[args.index(b"--config") + 1] == options.encode()
    assert stat.S_IMODE(Path(options).stat().st_mode) == 0o600
    assert yaml.safe_load(Path(options).read_text()) == {"api-key": key}


def _status(url: str, api_key: str = "") -> int:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


@pytest.mark.skipif(not SIM.exists(), reason="llmgw-sim is not installed")
@pytest.mark.parametrize("engine", sorted(ENGINES))
async def test_the_key_is_not_in_the_engines_cmdline(
    kit: Any, make_config: Callable[..., AgentConfig], reap: list[int], engine: str
) -> None:
    statuses: list[v1.ShardStatus] = []
    flags = {"vllm": "captured:0.32.0", "sglang": "", "llamacpp": "captured:b11434"}
    config = make_config(
        engines={k: {"command": c, "flags_from": flags[k]} for k, (_, c, _, _) in ENGINES.items()}
    )
    sup = Supervisor(
        config, gpus=dict.fromkeys(range(2), True), simulated=True, sink=statuses.append
    )
    sup.probes = type(sup.probes)(sup.probes.which, sup.probes.port_free, lambda p: True)
    kind, _, model_ref, gpus = ENGINES[engine]
    start = kit.make_start(
        engine=kind,
        model_ref=model_ref,
        gpu_indices=gpus,
        port=free_port(),
        env={"LLMGW_SIM_LOAD_TIME": "0.2"},
    )
    result = sup.start(start)
    assert result.ok, result.error
    pid = sup.engines[start.shard_id].pid
    reap.append(pid)

    async def ready() -> v1.ShardStatus | None:
        return next((s for s in statuses if s.state == S.READY), None)

    status = await wait_for_async(ready, timeout=90, what=f"READY in {statuses}")
    key = status.api_key
    assert len(key) >= 32
    options = sup.engines[start.shard_id].record.launch.api_key_file
    assert engine == "sglang" or options == ""
    _check_not_in_cmdline(pid, key, options if engine == "sglang" else None)
    # The engine still requires it (llama-server leaves /v1/models open, guards /metrics).
    guarded = status.endpoint_url + ("/metrics" if engine == "llamacpp" else "/v1/models")
    assert await asyncio.to_thread(_status, guarded) == 401
    assert await asyncio.to_thread(_status, guarded, key) == 200
    sup.stop(
        v1.StopShard(command_id="s", shard_id=start.shard_id, grace=datetime.timedelta(seconds=30))
    )

    async def stopped() -> bool:
        return any(s.state == S.STOPPED for s in statuses)

    await wait_for_async(stopped, timeout=60, what="STOPPED")
    if options:
        assert not await asyncio.to_thread(Path(options).exists)  # gone with the record
