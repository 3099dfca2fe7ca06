"""Issue 28 point 4: streams that survive an engine's death, through the whole system.

One fleet for the module (a control plane, two agents on two nodes, one replica of the
model on each, a router). Streams from the official openai client are in flight when
(1) an engine is SIGKILLed, (2) a node is lost (its agent and engines killed): no stream
is cut, and each client's text equals the uninterrupted answer (the simulated engines
are greedy: the text is a function of the prompt). (3) With every replica killed the
resume finds no engine and the stream ends with the error event, as without resuming.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections.abc import Iterator

import openai
import pytest
from llmgw_testkit import wait_for
from llmgw_testkit.cluster import Cluster, metric_sum, vllm_profile
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

STREAMS = 12
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("resume")
    cluster = Cluster(workdir)
    try:
        # One replica per node (4 GPUs each), tokens paced at 50 ms: a stream lasts ~3 s.
        profile = vllm_profile(gpus=4, replicas=2, env={"LLMGW_SIM_ITL": "0.05"})
        cluster.start_control([{"name": "chat", "profiles": {"default": profile}}])
        cluster.start_agent("gpu-a", gpus=4)
        cluster.start_agent("gpu-b", gpus=4)
        cluster.start_router()
        yield cluster
    finally:
        cluster.stop()
        logs = [*cluster.logs.glob("*.log"), *(workdir / "state").glob("*/logs/*.log")]
        for log in sorted(logs):
            text = log.read_text(errors="replace")
            if "Traceback" in text:
                print(f"----- {log.name} (last 30 lines)")
                print("\n".join(text.splitlines()[-30:]))


def _ready(cluster: Cluster, count: int) -> None:
    wait_for(
        lambda: len([r for r in cluster.replicas("chat") if r["state"] == "ready"]) == count,
        timeout=90,
        what=f"{count} chat replicas ready",
    )
    cluster.wait_router_models("chat")
    # The router has them all (a replica restarted comes back through the endpoint stream).
    wait_for(
        lambda: (
            metric_sum(cluster.router_metrics(), "llmgw_router_endpoints", state="ready") >= count
        ),
        timeout=60,
        what=f"{count} endpoints ready at the router",
    )


def _engines(cluster: Cluster, node: str) -> list[int]:
    pids = []
    for record in (cluster.workdir / "state" / node / "shards").glob("*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            pids.append(int(json.loads(record.read_text())["pid"]))
    return pids


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{cluster.router_url}/v1", api_key="x", max_retries=0, timeout=60
    )


def _prompt(i: int) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": f"Story number {i}, please, about the sea."}]


class Streams:
    """``STREAMS`` chat streams in threads: each one's text, or its error."""

    def __init__(self, cluster: Cluster) -> None:
        self.client = _client(cluster)
        self.texts: dict[int, str] = {}
        self.chunks: dict[int, int] = {}
        self.errors: dict[int, str] = {}
        self.threads = [threading.Thread(target=self._one, args=(i,)) for i in range(STREAMS)]

    def _one(self, i: int) -> None:
        text = []
        self.chunks[i] = 0
        try:
            stream = self.client.chat.completions.create(
                model="chat", messages=_prompt(i), max_tokens=MAX_TOKENS, stream=True
            )
            for chunk in stream:
                assert isinstance(chunk, ChatCompletionChunk)
                for choice in chunk.choices:
                    text.append(choice.delta.content or "")
                self.chunks[i] += 1
            self.texts[i] = "".join(text)
        except Exception as err:
            self.errors[i] = f"{type(err).__name__}: {err}"
            self.texts[i] = "".join(text)

    def __enter__(self) -> Streams:
        for t in self.threads:
            t.start()
        # Every stream under way (past its first few tokens) before anything is killed.
        wait_for(
            lambda: len(self.chunks) == STREAMS and min(self.chunks.values()) >= 5,
            timeout=60,
            what="every stream under way",
        )
        return self

    def __exit__(self, *exc: object) -> None:
        for t in self.threads:
            t.join(timeout=120)


def _whole(cluster: Cluster) -> dict[int, str]:
    """Each prompt's uninterrupted answer (one request, not streamed)."""
    client = _client(cluster)
    out = {}
    for i in range(STREAMS):
        reply = client.chat.completions.create(
            model="chat", messages=_prompt(i), max_tokens=MAX_TOKENS
        )
        out[i] = reply.choices[0].message.content or ""
    return out


def test_engine_killed_under_streaming_load_cuts_no_stream(fleet: Cluster) -> None:
    _ready(fleet, 2)
    want = _whole(fleet)
    before = metric_sum(fleet.router_metrics(), "llmgw_router_resumes_total")
    (victim,) = _engines(fleet, "gpu-a")
    with Streams(fleet) as streams:
        _kill(victim)
    assert streams.errors == {}
    assert streams.texts == want
    assert metric_sum(fleet.router_metrics(), "llmgw_router_resumes_total") > before


def test_node_lost_mid_stream_cuts_no_stream(fleet: Cluster) -> None:
    _ready(fleet, 2)
    want = _whole(fleet)
    engines = _engines(fleet, "gpu-b")
    before = metric_sum(fleet.router_metrics(), "llmgw_router_resumes_total")
    with Streams(fleet) as streams:
        # The node goes: its agent and its engines, at once.
        fleet.agents["gpu-b"].signal(signal.SIGKILL)
        for pid in engines:
            _kill(pid)
    assert streams.errors == {}
    assert streams.texts == want
    assert metric_sum(fleet.router_metrics(), "llmgw_router_resumes_total") > before


def test_every_replica_killed_ends_with_the_error_event(fleet: Cluster) -> None:
    # gpu-b is gone (the test before); the one replica left is on gpu-a.
    _ready(fleet, 1)
    with Streams(fleet) as streams:
        for pid in _engines(fleet, "gpu-a"):
            _kill(pid)
    # Each stream ends with the error event (openai raises it), after the text it had.
    assert sorted(streams.errors) == list(range(STREAMS))
    assert all("upstream" in e or "error" in e.lower() for e in streams.errors.values())
    assert all(streams.texts[i] for i in range(STREAMS))
    text = fleet.router_metrics()
    failed = metric_sum(text, "llmgw_router_resume_failures_total")
    assert failed >= STREAMS
