"""`llmgw-control serve` as a real process, against scripted agents over real gRPC streams.

Fixtures (conftest.py): ``control_factory(models, **control)`` starts the process
with short timings; ``agent_factory(port, node_id, ...)`` makes a FakeAgent;
``watcher_factory(port)`` subscribes to EndpointService.Watch like a router.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from llmgw_proto import v1
from llmgw_testkit import wait_for_async

S = v1.ShardState
Factory = Callable[..., Any]


def model(name: str = "m", replicas: int = 1, **profile: Any) -> dict[str, Any]:
    fields = {"engine": "vllm", "gpus_per_node": 1, "replicas": replicas, **profile}
    return {"name": name, "profiles": {"p": fields}}


def replicas_in(status: dict[str, Any], state: str) -> list[dict[str, Any]]:
    return [r for r in status["replicas"] if r["state"] == state]


def node_state(status: dict[str, Any], node_id: str) -> str | None:
    return next((n["state"] for n in status["nodes"] if n["node_id"] == node_id), None)


async def until(check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    async def probe() -> Any:
        return check()

    return await wait_for_async(probe, timeout=timeout, interval=0.05, what=what)


async def test_registration_start_and_publish(
    control_factory: Factory, agent_factory: Factory, watcher_factory: Factory
) -> None:
    control = control_factory(
        [
            model(
                "llama",
                engine_args=["--max-model-len", "4096"],
                served_model_names=["llama", "llama-chat"],
                env={"VLLM_LOGGING_LEVEL": "DEBUG"},
                weight=3,
                load_timeout="90s",
            )
        ]
    )
    watcher = watcher_factory(control.grpc_port)
    first = await watcher.until(lambda s: True, "the snapshot sent at subscribe")
    assert list(first.endpoints) == []

    agent = agent_factory(control.grpc_port, "gpu-a", labels={"fabric.nvlink-domain": "nvl-7"})
    agent.start()
    await until(lambda: agent.acks, "RegisterAck")
    assert agent.acks[0].session_id
    assert agent.acks[0].heartbeat_interval == dt.timedelta(seconds=0.3)

    (start,) = await until(agent.starts, "StartShard")
    assert (start.model, start.profile, start.engine) == ("llama", "p", v1.EngineKind.VLLM)
    assert start.model_ref == "llama"
    assert list(start.engine_args) == ["--max-model-len", "4096"]
    assert dict(start.env) == {"VLLM_LOGGING_LEVEL": "DEBUG"}
    assert list(start.served_model_names) == ["llama", "llama-chat"]
    assert list(start.gpu_indices) == [0]
    assert 21000 <= start.port <= 21099
    assert start.load_timeout == dt.timedelta(seconds=90)
    assert start.shard_id == f"{start.replica_id}-0"
    assert start.replica_id.startswith("llama.p.")
    assert (start.multi_node.rank, start.multi_node.size) == (0, 1)

    snap = await watcher.until(lambda s: len(s.endpoints) == 1, "the endpoint published")
    (endpoint,) = snap.endpoints
    assert endpoint.url == f"http://127.0.0.1:{start.port}"
    assert list(endpoint.served_model_names) == ["llama", "llama-chat"]
    assert (endpoint.replica_id, endpoint.node_id, endpoint.weight) == (
        start.replica_id,
        "gpu-a",
        3,
    )
    assert dict(endpoint.labels) == {"fabric.nvlink-domain": "nvl-7"}
    assert endpoint.health_path == "/health"
    assert snap.version > first.version

    status = await control.status()
    (node,) = status["nodes"]
    assert (node["state"], node["labels"], node["address"]) == (
        "READY",
        {"fabric.nvlink-domain": "nvl-7"},
        "127.0.0.1",
    )
    assert node["last_heartbeat"] is not None
    assert [g["in_use"] for g in node["gpus"]] == [True, False, False, False]
    (replica,) = replicas_in(status, "ready")
    assert replica["endpoint"] == endpoint.url

    code, metrics = await control.get("/metrics")
    assert code == 200
    assert 'llmgw_control_nodes{state="READY"} 1.0' in metrics
    assert "llmgw_control_heartbeats_total" in metrics
    # This control plane runs --insecure, and says so where health is checked.
    assert (await control.get("/healthz")) == (
        200,
        "ok (insecure: plaintext streams, peers not authenticated)\n",
    )


async def test_adoption_sends_nothing_to_adopted_shards_and_stops_unwanted(
    control_factory: Factory, agent_factory: Factory, watcher_factory: Factory
) -> None:
    control = control_factory([model(replicas=1)])
    agent = agent_factory(control.grpc_port, "gpu-a")
    agent.running["m.p.0000abcd-0"] = v1.RunningShard(
        shard_id="m.p.0000abcd-0", replica_id="m.p.0000abcd", model="m", profile="p",
        state=S.READY, endpoint_url="http://127.0.0.1:21042", gpu_indices=[2], port=21042,
        pid=4242, rank=0, world_size=1,
    )  # fmt: skip
    agent.running["old.x.1-0"] = v1.RunningShard(
        shard_id="old.x.1-0", replica_id="old.x.1", model="removed-model", profile="x",
        state=S.READY, gpu_indices=[3], port=21043, pid=4343, world_size=1,
    )  # fmt: skip
    agent.start()
    watcher = watcher_factory(control.grpc_port)
    snap = await watcher.until(lambda s: len(s.endpoints) == 1, "the adopted endpoint")
    assert snap.endpoints[0].url == "http://127.0.0.1:21042"
    assert snap.endpoints[0].replica_id == "m.p.0000abcd"
    await until(agent.stops, "the unwanted shard stopped")
    await control.passes(8)
    assert [s.shard_id for s in agent.stops()] == ["old.x.1-0"]
    assert agent.starts() == []
    assert agent.drains() == []
    (replica,) = (await control.status())["replicas"]
    assert (replica["replica_id"], replica["state"], replica["adopted"]) == (
        "m.p.0000abcd",
        "ready",
        True,
    )


async def test_unreachable_then_lost_then_replaced_and_old_shard_stopped(
    control_factory: Factory, agent_factory: Factory, watcher_factory: Factory
) -> None:
    control = control_factory([model()], unreachable_after="1s", lost_after="2.5s")
    a = agent_factory(control.grpc_port, "gpu-a")
    b = agent_factory(control.grpc_port, "gpu-b", gpus=2)
    # gpu-b registers first, so the replica is placed there whether the first placing pass
    # sees gpu-a too (gpu-b is the fuller node that fits: bin-packing) or not.
    b.start()
    await control.until(lambda s: node_state(s, "gpu-b") == "READY", "gpu-b registered")
    a.start()
    watcher = watcher_factory(control.grpc_port)
    (first,) = await until(b.starts, "start on gpu-b")
    await watcher.until(lambda s: len(s.endpoints) == 1, "endpoint on gpu-b")
    assert a.starts() == []

    await b.stop()  # the stream drops; the engine "keeps running" on gpu-b
    await control.until(lambda s: node_state(s, "gpu-b") == "UNREACHABLE", "gpu-b unreachable")
    # Unreachable is not lost: its endpoint stays published, nothing is replaced yet.
    assert [e.node_id for e in watcher.latest().endpoints] == ["gpu-b"]
    assert a.starts() == []

    await control.until(lambda s: node_state(s, "gpu-b") == "LOST", "gpu-b lost")
    (second,) = await until(a.starts, "replacement on gpu-a")
    assert second.replica_id != first.replica_id
    snap = await watcher.until(
        lambda s: [e.node_id for e in s.endpoints] == ["gpu-a"], "endpoint moved to gpu-a"
    )
    assert snap.endpoints[0].url == f"http://127.0.0.1:{second.port}"

    b.start()  # gpu-b comes back, still running the old shard
    await until(b.stops, "the old shard on gpu-b stopped")
    assert [s.shard_id for s in b.stops()] == [first.shard_id]
    await control.until(lambda s: node_state(s, "gpu-b") == "READY", "gpu-b ready again")
    await control.passes(5)
    assert len(a.starts()) == 1
    assert len(b.starts()) == 1


async def test_failed_starts_back_off_and_show_the_output_tail(
    control_factory: Factory, agent_factory: Factory
) -> None:
    control = control_factory([model()], base_backoff="0.5s", max_backoff="2s")
    agent = agent_factory(control.grpc_port, "gpu-a", mode="fail")
    agent.start()
    await until(lambda: len(agent.starts()) >= 1, "first start")
    status = await control.until(
        lambda s: s["replicas"] and s["replicas"][0]["failures"] >= 1 and s, "a recorded failure"
    )
    replica = status["replicas"][0]
    assert "exited with code 1 while loading" in replica["last_error"]
    assert "CUDA out of memory" in replica["output_tail"]
    await until(lambda: len(agent.starts()) >= 3, "two retries", timeout=45)
    ids = [s.shard_id for s in agent.starts()]
    replica_id = agent.starts()[0].replica_id
    assert ids[:3] == [f"{replica_id}-0", f"{replica_id}-0.1", f"{replica_id}-0.2"]
    status = await control.until(
        lambda s: s["replicas"][0]["failures"] >= 3 and s, "three failures counted"
    )
    assert status["replicas"][0]["replica_id"] == replica_id
    # It works again: the failure count resets once the replica is ready.
    agent.mode = "ready"
    await control.until(
        lambda s: s["replicas"][0]["state"] == "ready" and s["replicas"][0]["failures"] == 0,
        "ready after the backoff",
        timeout=45,
    )


async def test_scale_down_by_sighup_drains_and_a_bad_reload_keeps_the_catalog(
    control_factory: Factory, agent_factory: Factory, watcher_factory: Factory
) -> None:
    control = control_factory([model(replicas=2)])
    agent = agent_factory(control.grpc_port, "gpu-a")
    agent.start()
    watcher = watcher_factory(control.grpc_port)
    await watcher.until(lambda s: len(s.endpoints) == 2, "two endpoints")

    control.config.write_text("models: [{name: m, profiles: {p: {engine: tgi}}}]\n")
    control.proc.signal(signal.SIGHUP)
    control.proc.wait_output("config reload refused")
    assert "Invalid enum value 'tgi'" in control.proc.output()
    await control.passes(3)
    assert agent.drains() == []

    control.rewrite([model(replicas=1)])
    control.proc.signal(signal.SIGHUP)
    (drain,) = await until(agent.drains, "DrainShard")
    assert drain.deadline > dt.datetime.now(dt.UTC) + dt.timedelta(seconds=20)
    snap = await watcher.until(lambda s: len(s.endpoints) == 1, "one endpoint left")
    assert drain.shard_id not in {f"{e.replica_id}-0" for e in snap.endpoints}
    await control.until(lambda s: len(s["replicas"]) == 1, "the drained replica forgotten")
    await control.passes(3)
    assert agent.stops() == []
    assert len(agent.starts()) == 2


async def test_control_plane_restart_adopts_everything_and_touches_no_engine(
    control_factory: Factory, agent_factory: Factory, watcher_factory: Factory
) -> None:
    control = control_factory([model(replicas=3)])
    agents = [agent_factory(control.grpc_port, f"gpu-{i}", gpus=1) for i in range(3)]
    for agent in agents:
        agent.start(reconnect=True)
    await control.until(lambda s: len(replicas_in(s, "ready")) == 3, "three ready replicas")
    before = {a.node_id: [s.shard_id for s in a.starts()] for a in agents}
    assert all(len(v) == 1 for v in before.values())
    old_snapshot = await watcher_factory(control.grpc_port).until(
        lambda s: len(s.endpoints) == 3, "three endpoints before restart"
    )

    control.stop()
    await until(lambda: not any(a.connected.is_set() for a in agents), "streams dropped")
    control.start()
    # A router that resubscribes at once, before the agents are back, must not be
    # handed a partial set: it would drop endpoints whose engines serve fine.
    early = watcher_factory(control.grpc_port)
    status = await control.until(
        lambda s: len(replicas_in(s, "ready")) == 3 and s, "all adopted and ready again"
    )
    await early.until(lambda s: len(s.endpoints) == 3, "the early watcher's snapshot")
    assert [len(s.endpoints) for s in early.snapshots] == [3] * len(early.snapshots)
    # The replicas come back from the state store as they were (not re-adopted).
    assert {r["replica_id"] for r in status["replicas"]} == {
        s.replica_id for a in agents for s in a.starts()
    }
    assert {n["state"] for n in status["nodes"]} == {"READY"}
    watcher = watcher_factory(control.grpc_port)
    snap = await watcher.until(lambda s: len(s.endpoints) == 3, "three endpoints after restart")
    # A router keeps only newer snapshots: versions must not restart from zero.
    assert snap.version > old_snapshot.version
    assert [e.url for e in snap.endpoints] == [e.url for e in old_snapshot.endpoints]
    await control.passes(8)
    assert {a.node_id: [s.shard_id for s in a.starts()] for a in agents} == before
    assert [a.stops() for a in agents] == [[], [], []]
    assert [a.drains() for a in agents] == [[], [], []]


async def test_newer_stream_for_a_node_replaces_the_older(
    control_factory: Factory, agent_factory: Factory
) -> None:
    control = control_factory([model(replicas=0)])
    old = agent_factory(control.grpc_port, "gpu-a")
    old.start()
    await until(old.connected.is_set, "first stream")
    new = agent_factory(control.grpc_port, "gpu-a")
    new.start()
    await until(lambda: old.closed_by_server, "the older stream closed")
    # The server ends the older stream with ABORTED "replaced by a newer stream"; grpclib's
    # client reports that status when its own side was ended in time, and otherwise
    # "Outgoing stream was not ended" for the same close.
    ended = old.closed_by_server[0]
    assert "replaced by a newer stream" in ended or "Outgoing stream was not ended" in ended, ended
    assert control.proc is not None
    assert "newer stream replaces older" in control.proc.output()
    assert new.connected.is_set()
    assert old.acks[0].session_id != new.acks[0].session_id
    await control.passes(3)
    status = await control.status()
    assert [(n["node_id"], n["state"]) for n in status["nodes"]] == [("gpu-a", "READY")]


async def test_multi_node_replica_shares_a_label_and_publishes_the_leader(
    control_factory: Factory, agent_factory: Factory, watcher_factory: Factory
) -> None:
    label = "fabric.nvlink-domain"
    control = control_factory([model(gpus_per_node=4, nodes=2, same_label=label)])
    a = agent_factory(control.grpc_port, "gpu-a", labels={label: "nvl-1"})
    b = agent_factory(control.grpc_port, "gpu-b", labels={label: "nvl-2"})
    c = agent_factory(control.grpc_port, "gpu-c", labels={label: "nvl-1"})
    for agent in (a, b, c):
        agent.start()
    (lead,) = await until(a.starts, "rank 0 on gpu-a")
    (worker,) = await until(c.starts, "rank 1 on gpu-c")
    assert b.starts() == []
    assert (lead.multi_node.rank, worker.multi_node.rank) == (0, 1)
    assert lead.multi_node.size == worker.multi_node.size == 2
    assert lead.multi_node.leader_address == worker.multi_node.leader_address
    host, port = lead.multi_node.leader_address.rsplit(":", 1)
    assert host == "127.0.0.1"
    assert int(port) != lead.port
    assert list(lead.gpu_indices) == [0, 1, 2, 3]
    snap = await watcher_factory(control.grpc_port).until(
        lambda s: len(s.endpoints) == 1, "the leader's endpoint"
    )
    assert snap.endpoints[0].url == f"http://127.0.0.1:{lead.port}"
    assert snap.endpoints[0].node_id == "gpu-a"


async def test_status_and_explain_commands(
    control_factory: Factory, agent_factory: Factory
) -> None:
    control = control_factory([model("small"), model("huge", gpus_per_node=8)])
    agent = agent_factory(control.grpc_port, "gpu-a")
    agent.start()
    await control.until(lambda s: replicas_in(s, "ready"), "the small replica ready")

    async def cli(*args: str) -> subprocess.CompletedProcess[str]:
        # In a thread: the fake agent's heartbeats must keep flowing meanwhile.
        return await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "llmgw_control", *args, "--admin", control.admin],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    out = await cli("status")
    # The huge replica cannot be placed: status says so, and exits 3 (issue 29.7).
    assert out.returncode == 3, out.stderr
    assert "gpu-a" in out.stdout
    assert "READY" in out.stdout
    assert "1/4" in out.stdout
    assert "GPUS USED/TOTAL" in out.stdout  # the header says what it counts
    assert "too few GPUs matching '*'" in out.stdout  # the REASON column
    assert "UNPLACEABLE" in out.stdout
    assert (
        "0 of 1 nodes fit: 1 has too few GPUs matching '*' (need 8, most is 4 on gpu-a)"
        in out.stdout
    )

    out = await cli("explain", "huge")
    assert out.returncode == 0, out.stderr
    assert "huge / p: 1 wanted, 1 known" in out.stdout
    # An unplaced replica says why in a few words (issue 18.2), not "on nowhere".
    assert "unplaced: too few GPUs matching '*'" in out.stdout
    assert "on nowhere" not in out.stdout
    assert "why: 0 of 1 nodes fit" in out.stdout

    out = await cli("explain", "small")
    assert "ready  on gpu-a" in out.stdout
    assert "why: 1 of 1 nodes have 1 or more free GPUs; chose gpu-a, the fullest" in out.stdout

    out = await cli("explain", "nope")
    assert out.returncode == 1
    assert "model 'nope' is not in the catalog" in out.stderr

    out = await cli("status", "--json")
    assert out.returncode == 3
    assert '"node_id": "gpu-a"' in out.stdout
