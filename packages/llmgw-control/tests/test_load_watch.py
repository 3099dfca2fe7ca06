"""Issue 15.1, control side: load and cache figures from agents to routers on WatchLoad.

A real `llmgw-control serve`, a scripted agent sending LoadReport and CacheEvents up
its stream, and routers' ends of Watch and WatchLoad, all over real gRPC streams.
"""

from __future__ import annotations

import datetime as dt
import signal
from collections.abc import Callable
from typing import Any

from llmgw_proto import v1

Factory = Callable[..., Any]


def model(name: str = "m", replicas: int = 1) -> dict[str, Any]:
    return {
        "name": name,
        "profiles": {"p": {"engine": "vllm", "gpus_per_node": 1, "replicas": replicas}},
    }


def load_report(shard_id: str, *, waiting: int, running: int, kv: float) -> v1.AgentMessage:
    return v1.AgentMessage(
        load_report=v1.LoadReport(
            engines=[
                v1.EngineLoad(
                    shard_id=shard_id, known=True, running=running, waiting=waiting,
                    kv_cache_usage=kv, prefix_cache_queries=100, prefix_cache_hits=40,
                    generation=7,
                )
            ],
            time=dt.datetime.now(dt.UTC),
        )
    )  # fmt: skip


async def test_load_reaches_routers_apart_from_snapshots(
    control_factory: Factory,
    agent_factory: Factory,
    watcher_factory: Factory,
    load_watcher_factory: Factory,
) -> None:
    control = control_factory([model(replicas=2)], load_interval="100ms")
    agent = agent_factory(control.grpc_port, "gpu-a")
    agent.start()
    watcher = watcher_factory(control.grpc_port)
    snap = await watcher.until(lambda s: len(s.endpoints) == 2, "two endpoints")
    assert agent.acks[0].load_interval == dt.timedelta(milliseconds=100)
    assert [m.name for m in snap.models] == ["m"]
    first, second = sorted(snap.endpoints, key=lambda e: e.id)
    assert first.generation
    assert second.generation
    assert first.generation != second.generation
    assert first.engine == v1.EngineKind.VLLM
    shard_of = {s.replica_id: s.shard_id for s in agent.starts()}

    routers = [load_watcher_factory(control.grpc_port, f"r{i}") for i in range(2)]
    try:
        for router in routers:
            await router.until(lambda r=router: r.updates, "the full picture on subscribe")
            full = router.updates[0]
            assert full.full
            assert sorted(x.endpoint_id for x in full.loads) == [first.id, second.id]
            assert not any(x.known for x in full.loads)  # nothing reported yet

        await agent.send(load_report(shard_of[first.id], waiting=5, running=3, kv=0.5))
        for router in routers:
            load = await router.until(
                lambda r=router: (x := r.latest_load(first.id)) is not None and x.known and x,
                "the reported load at the router",
            )
            assert (load.waiting, load.running) == (5, 3)
            assert abs(load.kv_cache_usage - 0.5) < 1e-6
            assert (load.prefix_cache_queries, load.prefix_cache_hits) == (100, 40)
            # The endpoint's generation (the snapshot's), not the agent's own number.
            assert load.generation == first.generation
            assert load.age is not None
            assert load.age < dt.timedelta(seconds=30)
        # Cache events are relayed per endpoint, in the endpoint's generation.
        await agent.send(
            v1.AgentMessage(
                cache_events=v1.CacheEvents(
                    shard_id=shard_of[first.id], stored=[11, 12, 13], block_size=16
                )
            )
        )
        cache = await routers[0].until(
            lambda: next((c for u in routers[0].updates for c in u.caches if 12 in c.stored), None),
            "the cache events at the router",
        )
        assert (cache.endpoint_id, cache.block_size) == (first.id, 16)
        assert cache.generation == first.generation
        # A load change never bumps the snapshot version.
        await agent.send(load_report(shard_of[first.id], waiting=9, running=3, kv=0.6))
        await routers[0].until(
            lambda: (x := routers[0].latest_load(first.id)) is not None and x.waiting == 9,
            "the second report",
        )
        assert watcher.latest().version == snap.version
        status = await control.status()
        (replica,) = [r for r in status["replicas"] if r["replica_id"] == first.id]
        assert replica["load"]["waiting"] == 9

        # A router that subscribes now gets the whole picture at once, blocks included.
        late = load_watcher_factory(control.grpc_port, "late")
        routers.append(late)
        await late.until(lambda: late.updates, "the late router's full picture")
        assert late.updates[0].full
        late_load = late.latest_load(first.id)
        assert late_load is not None
        assert late_load.waiting == 9
        (blocks,) = [c for c in late.updates[0].caches if c.endpoint_id == first.id]
        assert sorted(blocks.stored) == [11, 12, 13]
        assert blocks.cleared

        # An endpoint that goes away takes its figures with it.
        control.rewrite([model(replicas=1)], load_interval="100ms")
        control.proc.signal(signal.SIGHUP)
        await watcher.until(lambda s: len(s.endpoints) == 1, "one endpoint left")
        (kept,) = watcher.latest().endpoints
        gone = first.id if kept.id == second.id else second.id
        await routers[0].until(
            lambda: (x := routers[0].latest_load(gone)) is not None and not x.known and x,
            "the gone endpoint unknown at the router",
        )
        newest = load_watcher_factory(control.grpc_port, "newest")
        routers.append(newest)
        await newest.until(lambda: newest.updates, "a full picture after the drain")
        assert [x.endpoint_id for x in newest.updates[0].loads] == [kept.id]
    finally:
        for router in routers:
            await router.stop()
