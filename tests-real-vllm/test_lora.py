"""Issue 30 on a real vLLM (CPU): LoRA adapters loaded at runtime through llmgw.

Three adapters for gemma-3 270M are made offline (tools/make_lora.py: random, non-zero,
seeded) and declared in the catalog; two engines run with the catalog's LoRA flags
(`--enable-lora --max-loras 1 --max-lora-rank 8`, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True).
A request naming an adapter no engine holds is held at the router, the control plane has
the agent load it through vLLM's /v1/load_lora_adapter, and the request is served by it,
with an answer that differs from the base model's. The router sends an adapter's requests to
its holder, a second adapter is loaded on the engine with a free slot, and a third, with
both engines full, unloads the least used of the two for it (the hot one stays).

Its own system (two engines, LoRA on, about 10 GB), started once for the module and stopped
before the suite's shared system starts (this file runs first).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from llmgw_testkit import wait_for
from llmgw_testkit.cluster import Cluster, metric_sum

ROOT = Path(__file__).resolve().parent.parent
SERVED_NAME = "gemma3"
PROMPT = "The capital of France is"
# Over two of the engines' 32-token blocks.
LONG_PROMPT = " ".join(f"item {i} of the list," for i in range(40))


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
    own_system: Any,
    cpu_agent: dict[str, Any],
    engine: Any,
    profile: dict[str, Any],
    hf_model: Path,
) -> Iterator[Cluster]:
    if engine.kind != "vllm":
        pytest.skip("runtime LoRA through llmgw is tested on vLLM")
    workdir = tmp_path_factory.mktemp("real-lora")
    adapters = [
        {"name": name, "source": str(make_adapter(engine, hf_model, workdir / name, seed))}
        for name, seed in (("gemma3-a", 1), ("gemma3-b", 2), ("gemma3-c", 3))
    ]
    lora_profile = {**profile, "replicas": 2, "lora": {"max_loras": 1, "max_rank": 8}}
    with own_system(workdir) as cluster:
        model = {"name": SERVED_NAME, "profiles": {"cpu": lora_profile}, "adapters": adapters}
        cluster.start_control([model])
        cluster.start_router(
            hold={"hold_timeout": "300s", "demand_interval": "500ms"},
            # Precise matching: an adapter's prompt is tokenized as its base model's.
            cache_aware={"tokenizers": {SERVED_NAME: str(hf_model)}},
        )
        cluster.start_agent("cpu-a", **cpu_agent)
        cluster.wait_replicas(SERVED_NAME, 2, timeout=900)
        cluster.wait_router_models(SERVED_NAME, "gemma3-a", "gemma3-b", "gemma3-c", timeout=60)
        yield cluster


def _holders(cluster: Cluster, adapter: str) -> list[str]:
    found: list[str] = cluster.status()["lora"]["adapters"][adapter]["holders"]
    return found


def _served(cluster: Cluster) -> dict[str, float]:
    """The router's answered requests (status 200) by the endpoint (replica) that served
    them."""
    text = cluster.router_metrics()
    return {
        r["replica_id"]: metric_sum(
            text, "llmgw_router_requests_total", status="200", endpoint=r["replica_id"]
        )
        for r in cluster.replicas(SERVED_NAME)
    }


def test_adapters_load_at_runtime_route_to_holders_and_evict(lora_system: Cluster) -> None:
    cluster = lora_system
    client = openai.OpenAI(
        base_url=f"{cluster.router_url}/v1", api_key="x", max_retries=0, timeout=600
    )

    def ask(model: str) -> tuple[str, str]:
        """The answer, and the endpoint that served it (the router's own count)."""
        before = _served(cluster)
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
        after = _served(cluster)
        (endpoint,) = [e for e, n in after.items() if n > before.get(e, 0.0)]
        return out.choices[0].text, endpoint

    base, _ = ask(SERVED_NAME)
    assert _holders(cluster, "gemma3-a") == []
    # Held until the agent has loaded it through vLLM's runtime API, then served by it.
    with_a, served = ask("gemma3-a")
    (holder_a,) = _holders(cluster, "gemma3-a")
    assert served == holder_a
    assert with_a != base
    # Routed to its holder, every time (the other engine does not hold it).
    for _ in range(6):
        assert ask("gemma3-a") == (with_a, holder_a)  # greedy: the same adapter answers the same

    # Precise matching keys an adapter's blocks on the adapter: vLLM's cache events name the
    # LoRA (lora_name), the agent chains those blocks from its root, and the router chains
    # the adapter's prompt from the same root (its own /v1/match shows what it counts).
    def match(model: str) -> dict[str, int]:
        body = {"model": model, "prompt": LONG_PROMPT}
        url = f"http://127.0.0.1:{cluster.router_admin_port}/v1/match"
        answer = httpx.post(url, json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        return {e["id"]: e["cached_blocks"] for e in answer.json()["endpoints"]}

    client.completions.create(model="gemma3-a", prompt=LONG_PROMPT, max_tokens=1, temperature=0)
    wait_for(
        lambda: match("gemma3-a").get(holder_a, 0) >= 2,
        timeout=60,
        what="the adapter's prompt blocks cached at its holder, as the router counts them",
    )
    # Under the base model the same prompt was never asked: nothing of it is cached there.
    assert match(SERVED_NAME)[holder_a] == 0
    # A second adapter goes to the engine with a free slot.
    with_b, served = ask("gemma3-b")
    (holder_b,) = _holders(cluster, "gemma3-b")
    assert holder_b != holder_a
    assert served == holder_b
    assert with_b not in (base, with_a)
    assert _holders(cluster, "gemma3-a") == [holder_a]
    assert ask("gemma3-a") == (with_a, holder_a)
    # Both engines full: the third unloads the least used adapter (gemma3-b: one request
    # against gemma3-a's nine, and the least recent) and takes its slot; the hot one stays.
    with_c, served = ask("gemma3-c")
    assert with_c not in (base, with_a, with_b)
    assert served == holder_b
    wait_for(
        lambda: _holders(cluster, "gemma3-c") == [holder_b] and not _holders(cluster, "gemma3-b"),
        timeout=120,
        what="gemma3-b unloaded for gemma3-c",
    )
    assert _holders(cluster, "gemma3-a") == [holder_a]
    assert ask("gemma3-a") == (with_a, holder_a)
    status = cluster.status()["lora"]
    assert status["loads"] == 3
    assert status["unloads"] == 1
    assert status["load_failures"] == 0
