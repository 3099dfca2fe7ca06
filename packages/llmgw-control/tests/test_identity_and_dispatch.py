"""Over real streams: mTLS node identity, malformed registration, unanswered commands."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmgw_control.ca import init_ca, issue
from llmgw_proto.tls import client_context
from llmgw_testkit import wait_for_async

Factory = Callable[..., Any]


def model(replicas: int = 1) -> dict[str, Any]:
    return {
        "name": "m",
        "profiles": {"p": {"engine": "vllm", "gpus_per_node": 1, "replicas": replicas}},
    }


async def until(check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    async def probe() -> Any:
        return check()

    return await wait_for_async(probe, timeout=timeout, interval=0.05, what=what)


async def test_mtls_a_node_speaks_only_for_itself(
    tmp_path: Path, control_factory: Factory, agent_factory: Factory
) -> None:
    ca = init_ca(tmp_path / "ca")
    server = issue(tmp_path / "ca", "server", "control", hosts=["127.0.0.1"], out=tmp_path / "s")
    node = issue(tmp_path / "ca", "node", "gpu-a", out=tmp_path / "n")
    router = issue(tmp_path / "ca", "router", "edge-1", out=tmp_path / "r")
    control = control_factory(
        [model(replicas=0)],
        tls={"cert": str(server.cert), "key": str(server.key), "ca": str(ca.cert)},
    )
    as_node = client_context(node.cert, node.key, ca.cert)

    honest = agent_factory(control.grpc_port, "gpu-a", ssl=as_node)
    honest.start()
    await until(honest.connected.is_set, "gpu-a registered over mTLS")

    liar = agent_factory(control.grpc_port, "gpu-a", ssl=as_node, register_as="gpu-b")
    liar.start()
    await until(lambda: liar.closed_by_server, "gpu-b refused")
    assert "certificate is for node 'gpu-a', not node 'gpu-b'" in liar.closed_by_server[0]

    not_a_node = agent_factory(
        control.grpc_port, "edge-1", ssl=client_context(router.cert, router.key, ca.cert)
    )
    not_a_node.start()
    await until(lambda: not_a_node.closed_by_server, "a router certificate refused")
    assert "certificate is for router 'edge-1'" in not_a_node.closed_by_server[0]

    plaintext = agent_factory(control.grpc_port, "gpu-c")
    plaintext.start()
    await until(lambda: plaintext.closed_by_server, "plaintext refused")
    assert not plaintext.acks

    status = await control.status()
    assert [(n["node_id"], n["state"]) for n in status["nodes"]] == [("gpu-a", "READY")]
    assert honest.connected.is_set()


async def test_register_without_node_id_is_refused(
    control_factory: Factory, agent_factory: Factory
) -> None:
    control = control_factory([model()])
    nameless = agent_factory(control.grpc_port, "x", register_as="")
    nameless.start()
    await until(lambda: nameless.closed_by_server, "the stream refused")
    assert "must be a Register with a node_id" in nameless.closed_by_server[0]
    assert (await control.status())["nodes"] == []


async def test_an_unanswered_start_is_sent_again(
    control_factory: Factory, agent_factory: Factory
) -> None:
    control = control_factory([model()], command_timeout="1s")
    agent = agent_factory(control.grpc_port, "gpu-a", mode="silent")
    agent.start()
    await until(lambda: len(agent.starts()) >= 2, "the start sent again")
    first, second = agent.starts()[:2]
    assert first.shard_id == second.shard_id
    assert first.command_id != second.command_id
    code, metrics = await control.get("/metrics")
    assert code == 200
    assert 'llmgw_control_commands_total{kind="start",result="error"}' in metrics
