"""Issue 32 on a real vLLM (CPU): prefill/decode disaggregation with the NIXL connector.

A disaggregated profile (one prefill and one decode replica on one fabric label) is placed
by the control plane; the agent launches each vLLM with the connector it sets for a role
(``--kv-transfer-config`` NixlConnector, the side channel on the port placement gave); the
router runs vLLM's two-phase exchange: the prefill engine computes the prompt (one token,
``kv_transfer_params`` asking for remote decode), the decode engine pulls its KV cache over
NIXL (UCX, host memory: vLLM's CPU platform keeps the KV buffer on the CPU) and generates.
The decode engine's own NIXL metrics count each transfer, and greedy decoding from the
transferred cache gives the prefill engine's own answer to the same prompt.

Its own system (two engines, about 10 GB), started once for the module and stopped
before the suite's shared system starts; each engine pinned to a core of its own
(:func:`pin_engines` says why).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from llmgw_testkit import serving_checks as checks
from llmgw_testkit import wait_for
from llmgw_testkit.cluster import Cluster, metric_sum

SERVED_NAME = "gemma3"
LABEL = "fabric.ib-subnet"
PROMPT = (
    "The capital of France is Paris. The capital of Germany is Berlin. "
    "The capital of Italy is Rome. The capital of Spain is"
)


@pytest.fixture(scope="module")
def pd_system(
    tmp_path_factory: pytest.TempPathFactory,
    own_system: Any,
    cpu_agent: dict[str, Any],
    engine: Any,
    profile: dict[str, Any],
) -> Iterator[Cluster]:
    if engine.kind != "vllm":
        pytest.skip("the NIXL two-phase exchange is tested on vLLM")
    pd = {k: v for k, v in profile.items() if k != "replicas"}
    pd.update(fabric_label=LABEL, prefill={"replicas": 1}, decode={"replicas": 1})
    with own_system(tmp_path_factory.mktemp("real-pd")) as cluster:
        cluster.start_control([{"name": SERVED_NAME, "profiles": {"cpu": pd}}])
        cluster.start_router()
        cluster.start_agent("cpu-a", labels={LABEL: "ib-1"}, **cpu_agent)
        # Each engine on a core of its own, before it starts its engine core and workers
        # (they take the affinity they are started with).
        wait_for(lambda: pin_engines(cluster) == 2, timeout=120, what="both engines launched")
        cluster.wait_replicas(SERVED_NAME, 2, timeout=900)
        pin_engines(cluster)
        cluster.wait_router_models(SERVED_NAME, timeout=60)
        yield cluster


def _tree(pid: int) -> list[int]:
    """``pid`` and every process under it."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # The parent pid is the second field after the command's closing parenthesis.
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def pin_engines(cluster: Cluster) -> int:
    """Put the prefill engine (every process and thread of it) on this machine's first core
    and the decode engine on its second; the number of engines pinned.

    Each engine's NIXL agent runs a progress thread that polls UCX without pause, a core's
    worth of CPU even when idle (nixl 1.5.1). On a node each engine has cores of its own; on
    this two-core machine the two engines otherwise starve each other: a decode engine then
    took 45 s to pull a 27-token prompt's cache, after the prefill engine's lease on the
    blocks had run out (it logs that they may be invalid). Pinned: 1.5 s."""
    cores = sorted(os.sched_getaffinity(0))
    pinned = 0
    for rep in cluster.replicas(SERVED_NAME):
        pid = rep["shards"][0].get("pid") if rep["shards"] else None
        if not pid:
            continue
        core = cores[0] if rep["profile"].endswith("-prefill") else cores[1 % len(cores)]
        for proc in _tree(int(pid)):
            for task in Path(f"/proc/{proc}/task").glob("*"):
                with contextlib.suppress(OSError, ValueError):
                    os.sched_setaffinity(int(task.name), {core})
        pinned += 1
    return pinned


def engine_metric(url: str, name: str) -> float:
    return metric_sum(httpx.get(f"{url}/metrics", timeout=10).text, name)


def test_prefill_then_decode_over_nixl(pd_system: Cluster) -> None:
    cluster = pd_system
    by_profile = {r["profile"]: r for r in cluster.replicas(SERVED_NAME)}
    assert sorted(by_profile) == ["cpu-decode", "cpu-prefill"]
    prefill, decode = by_profile["cpu-prefill"], by_profile["cpu-decode"]
    for rep in (prefill, decode):
        argv = checks.cmdline(rep["shards"][0]["pid"])
        config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert config["kv_connector"] == "NixlConnector"
    client = openai.OpenAI(
        base_url=f"{cluster.router_url}/v1", api_key="x", max_retries=0, timeout=600
    )
    transfers = engine_metric(decode["endpoint"], "vllm:nixl_xfer_time_seconds_count")
    prefilled = engine_metric(prefill["endpoint"], "vllm:request_success_total")
    out = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    # The decode engine pulled the prompt's KV cache from the prefill engine, once.
    assert engine_metric(decode["endpoint"], "vllm:nixl_xfer_time_seconds_count") == transfers + 1
    assert engine_metric(prefill["endpoint"], "vllm:request_success_total") == prefilled + 1
    assert out.usage is not None
    assert out.usage.completion_tokens == 12
    pairs = metric_sum(
        cluster.router_metrics(),
        "llmgw_router_disagg_pairs_total",
        prefill=prefill["replica_id"],
        decode=decode["replica_id"],
    )
    assert pairs == 1
    # Greedy decoding from the transferred cache answers as the prefill engine does from
    # its own (asked directly, as a reference only: clients reach engines through the router).
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    key = checks.engine_secret(prefill["shards"][0]["pid"], "VLLM_API_KEY")
    answer = httpx.post(
        f"{prefill['endpoint']}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=600,
    )
    assert answer.status_code == 200, answer.text
    reference = answer.json()["choices"][0]["text"]
    assert out.choices[0].text == reference
    assert reference.strip()

    # A streamed chat completion takes the same two phases, and streams from the decode engine.
    stream = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=16,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.strip()
    assert engine_metric(decode["endpoint"], "vllm:nixl_xfer_time_seconds_count") == transfers + 2
    assert (
        metric_sum(cluster.router_metrics(), "llmgw_router_disagg_pairs_total", model=SERVED_NAME)
        == 2
    )
