"""A READY shard whose endpoint URL cannot be parsed is FAILED, never published (issue 24.7).

A node reporting READY with ``http://127.0.0.1:99999`` was published as given; routers
then answered 500s. The control plane now parses every READY endpoint URL with
``llmgw_proto.addr.parse_endpoint_url`` and fails the shard, saying why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from hypothesis import given
from hypothesis import strategies as st
from llmgw_control.catalog import ModelConfig, build_catalog
from llmgw_control.inventory import GpuSlot, Node, ShardReport
from llmgw_control.reconciler import Decision, Settings, reconcile
from llmgw_control.records import ControlState, Start, Stop
from llmgw_proto import v1
from llmgw_proto.addr import parse_endpoint_url
from llmgw_testkit import wait_for_async

S = v1.ShardState
Factory = Callable[..., Any]
BAD = "http://127.0.0.1:99999"


def test_a_ready_report_with_a_bad_url_is_refused_with_the_reason() -> None:
    report = ShardReport("r-0", "r", S.READY, endpoint_url=BAD)
    assert report.refused == (
        f"refused to publish: endpoint URL '{BAD}': port 99999 is not in 1-65535"
    )
    assert report.running, "the engine still runs: its GPUs and port stay taken"
    for url in ("http://:8000", "127.0.0.1:8000", "http://h:0", "ftp://h:1"):
        assert repr(url) in ShardReport("r-0", "r", S.READY, endpoint_url=url).refused


def test_good_urls_and_other_states_are_not_refused() -> None:
    for url in ("http://127.0.0.1:20000", "http://[::1]:8000", "https://gpu-a.internal:443"):
        assert ShardReport("r-0", "r", S.READY, endpoint_url=url).refused == ""
    # Not READY: nothing is published, nothing to refuse; an empty URL (headless, or
    # not told yet) keeps its own warning in status.
    assert ShardReport("r-0", "r", S.STARTING, endpoint_url=BAD).refused == ""
    assert ShardReport("r-0", "r", S.READY, endpoint_url="").refused == ""


@given(st.text(max_size=40), st.sampled_from(list(S)))
def test_refused_exactly_when_ready_at_an_unparseable_url(url: str, state: S) -> None:
    try:
        parse_endpoint_url(url)
        parses = True
    except ValueError:
        parses = False
    refused = ShardReport("r-0", "r", state, endpoint_url=url).refused
    assert bool(refused) == (state == S.READY and bool(url) and not parses)
    assert refused == "" or refused.startswith("refused to publish: endpoint URL ")


SETTINGS = Settings(
    port_range=(20000, 20099),
    mgmt_interface="lo",
    base_backoff=1.0,
    max_backoff=8.0,
    drain_timeout=10.0,
    stop_grace=5.0,
    startup_grace=0.0,
    adopt_grace=30.0,
)


def test_a_refused_replica_fails_its_engine_is_stopped_and_nothing_is_adopted() -> None:
    """The reconciler's decision, pure: fail the replica, stop the engine, retry later."""
    models = msgspec.convert(
        [{"name": "m", "profiles": {"p": {"engine": "vllm", "gpus_per_node": 2}}}],
        list[ModelConfig],
    )
    cat = build_catalog(models, "control.yaml")
    node = Node(
        "a",
        "s1",
        gpus=tuple(GpuSlot(i, "NVIDIA H100", 80 * 2**30) for i in range(4)),
        interfaces={"lo": ["127.0.0.1"]},
    )
    nodes = {"a": node}
    ids = (f"m.p.{i}" for i in range(100))
    now = 100.0

    def step(state: ControlState) -> Decision:
        return reconcile(cat, nodes, state, now, SETTINGS, lambda m, p: next(ids))

    first = step(ControlState())
    (start,) = [c for c in first.commands if isinstance(c, Start)]
    node.shards[start.shard_id] = ShardReport(
        start.shard_id, start.replica_id, S.READY, model="m", profile="p",
        gpu_indices=start.gpu_indices, port=start.port, endpoint_url=BAD,
    )  # fmt: skip
    decision = step(first.state)
    replica = decision.state.replicas[start.replica_id]
    assert replica.failures == 1
    assert replica.last_error == (
        f"{start.shard_id}: refused to publish: endpoint URL '{BAD}': port 99999 is not in 1-65535"
    )
    assert Stop("a", start.shard_id, 5.0) in decision.commands
    # Not adopted as a replica of its own, and its GPUs stay taken until it stops.
    assert list(decision.state.replicas) == [start.replica_id]
    now += 1.0
    (retry,) = [c for c in step(decision.state).commands if isinstance(c, Start)]
    assert retry.shard_id == f"{start.replica_id}-0.1"
    assert not set(retry.gpu_indices) & set(start.gpu_indices)


async def test_a_node_reporting_ready_at_a_bad_url_is_failed_not_published(
    control_factory: Factory, agent_factory: Factory, watcher_factory: Factory
) -> None:
    """Real `llmgw-control serve`, a scripted agent and a router's Watch over real gRPC."""
    control = control_factory(
        [{"name": "m", "profiles": {"p": {"engine": "vllm", "gpus_per_node": 1}}}],
        base_backoff="0.5s",
        max_backoff="1s",
    )
    watcher = watcher_factory(control.grpc_port)
    agent = agent_factory(control.grpc_port, "gpu-a")
    # Its READY reports carry the bad URL while one is set here.
    bad: dict[str, str | None] = {"url": BAD}
    honest = agent.status

    async def status(stream: Any, shard_id: str, replica_id: str, state: S, **kw: Any) -> None:
        if "endpoint_url" in kw and bad["url"] is not None:
            kw["endpoint_url"] = bad["url"]
        await honest(stream, shard_id, replica_id, state, **kw)

    agent.status = status
    agent.start()
    try:
        seen = await control.until(
            lambda s: s["replicas"] and s["replicas"][0]["failures"] >= 1 and s,
            "the READY shard at a bad URL failed",
        )
        replica = seen["replicas"][0]
        assert replica["last_error"].endswith(
            f"refused to publish: endpoint URL '{BAD}': port 99999 is not in 1-65535"
        )
        assert not replica["published"]
        # The agent is told to stop the engine it reported.
        first = agent.starts()[0]

        async def stopped() -> bool:
            return any(s.shard_id == first.shard_id for s in agent.stops())

        await wait_for_async(stopped, timeout=30, interval=0.05, what="StopShard for it")
        # Fixed, the retry is published at the agent's (now good) URL.
        bad["url"] = None
        snap = await watcher.until(lambda s: len(s.endpoints) == 1, "the retry published")
        assert snap.endpoints[0].url.startswith("http://127.0.0.1:")
        # No snapshot ever carried the bad URL.
        assert all(ep.url != BAD for s in watcher.snapshots for ep in s.endpoints)
    finally:
        await agent.stop()
