"""Issue 30 on a real vLLM (CPU): LoRA adapters loaded at runtime through llmgw.

Two adapters for gemma-3 270M are made offline (tools/make_lora.py: random, non-zero,
seeded) and declared in the catalog; the engine runs with the catalog's LoRA flags
(`--enable-lora --max-loras 1 --max-lora-rank 8`, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True).
A request naming an adapter no engine holds is held at the router, the control plane has
the agent load it through vLLM's /v1/load_lora_adapter, and the request is served by it,
with an answer that differs from the base model's. The engine holds one adapter at once:
asking for the second unloads the first (least recently used) for it.

Its own system (one engine, LoRA on), started once for the module and stopped before the
suite's shared system starts (this file runs first).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from llmgw_testkit import wait_for
from llmgw_testkit.cluster import Cluster

ROOT = Path(__file__).resolve().parent.parent
SERVED_NAME = "gemma3"
PROMPT = "The capital of France is"
# As the suite's shared system (conftest.TIMINGS): two busy cores, a slow engine start.
TIMINGS = {
    "unreachable_after": "20s",
    "lost_after": "900s",
    "drain_timeout": "180s",
    "stop_grace": "30s",
    "command_timeout": "60s",
}


def make_adapter(engine: Any, hf_model: Path, out: Path, seed: int) -> Path:
    """An adapter made by tools/make_lora.py with the engine venv's torch."""
    python = Path(engine.command[0]).parent / "python"
    argv = [str(python if python.exists() else sys.executable), str(ROOT / "tools/make_lora.py")]
    argv += ["--model", str(hf_model), "--out", str(out), "--seed", str(seed)]
    subprocess.run(argv, check=True, timeout=600, capture_output=True)
    return out


@pytest.fixture(scope="module")
def lora_system(
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
    engine: Any,
    profile: dict[str, Any],
    hf_model: Path,
) -> Iterator[Cluster]:
    if engine.kind != "vllm":
        pytest.skip("runtime LoRA through llmgw is tested on vLLM")
    workdir = tmp_path_factory.mktemp("real-lora")
    adapters = [
        {"name": name, "source": str(make_adapter(engine, hf_model, workdir / name, seed))}
        for name, seed in (("gemma3-a", 1), ("gemma3-b", 2))
    ]
    lora_profile = {**profile, "lora": {"max_loras": 1, "max_rank": 8}}
    cluster = Cluster(workdir, timings=TIMINGS)
    saved = {key: os.environ.get(key) for key in engine.agent_env}
    os.environ.update(engine.agent_env)
    try:
        model = {"name": SERVED_NAME, "profiles": {"cpu": lora_profile}, "adapters": adapters}
        cluster.start_control([model])
        cluster.start_router(hold={"hold_timeout": "300s", "demand_interval": "500ms"})
        cluster.start_agent(
            "cpu-a",
            simulate_gpus=None,
            engines={engine.kind: {"command": engine.command}},
            stop_engines_on_exit=True,
            stop_grace="30s",
        )
        cluster.wait_replicas(SERVED_NAME, 1, timeout=900)
        cluster.wait_router_models(SERVED_NAME, "gemma3-a", "gemma3-b", timeout=60)
        yield cluster
    finally:
        cluster.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if request.session.testsfailed:
            for log in sorted([*cluster.logs.glob("*.log"), *workdir.glob("state/*/logs/*.log")]):
                print(f"----- {log} (last 60 lines)")
                print("\n".join(log.read_text(errors="replace").splitlines()[-60:]))


def _holders(cluster: Cluster, adapter: str) -> list[str]:
    found: list[str] = cluster.status()["lora"]["adapters"][adapter]["holders"]
    return found


def test_adapters_load_at_runtime_answer_differently_and_evict(lora_system: Cluster) -> None:
    cluster = lora_system
    client = openai.OpenAI(
        base_url=f"{cluster.router_url}/v1", api_key="x", max_retries=0, timeout=600
    )

    def ask(model: str) -> str:
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
        return out.choices[0].text

    base = ask(SERVED_NAME)
    assert _holders(cluster, "gemma3-a") == []
    # Held until the agent has loaded it through vLLM's runtime API, then served by it.
    with_a = ask("gemma3-a")
    (holder,) = _holders(cluster, "gemma3-a")
    assert with_a != base
    assert ask("gemma3-a") == with_a  # greedy: the same adapter answers the same
    # The engine holds one at once: the second adapter unloads the first.
    with_b = ask("gemma3-b")
    assert with_b not in (base, with_a)
    wait_for(
        lambda: _holders(cluster, "gemma3-b") == [holder] and not _holders(cluster, "gemma3-a"),
        timeout=120,
        what="gemma3-a unloaded for gemma3-b",
    )
    status = cluster.status()["lora"]
    assert status["loads"] == 2
    assert status["unloads"] == 1
    assert status["load_failures"] == 0
