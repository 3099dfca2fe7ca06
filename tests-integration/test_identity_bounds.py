"""Issue 24, points 1-2, with the whole system as real processes: a real control plane
with mTLS, a real agent (simulated engines) and crafted clients that are refused."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from pathlib import Path
from typing import Any

import grpclib.client
import grpclib.const
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError
from llmgw_proto import v1
from llmgw_proto.tls import client_context
from llmgw_testkit import wait_for
from llmgw_testkit.certs import CN, ORG, OU, name_attr, sign_client
from llmgw_testkit.cluster import Cluster, metric_sum, vllm_profile

MiB = 1024 * 1024


async def _first_status(port: int, ctx: ssl.SSLContext, msg: v1.AgentMessage) -> Any:
    """Open AgentService/Connect, send ``msg``: the status the control plane ends it with."""
    channel = grpclib.client.Channel("127.0.0.1", port, ssl=ctx)
    stream = channel.request(
        "/llmgw.v1.AgentService/Connect",
        grpclib.const.Cardinality.STREAM_STREAM,
        v1.AgentMessage,
        v1.ControlMessage,
    )
    try:
        async with asyncio.timeout(120), stream:
            await stream.send_request()
            sending = asyncio.create_task(stream.send_message(msg))
            try:
                first = await stream.recv_message()
            except StreamTerminatedError:
                first = None
            finally:
                sending.cancel()
                with contextlib.suppress(BaseException):
                    await sending
            if first is not None:
                await stream.cancel()
                return grpclib.const.Status.OK
    except GRPCError as err:
        return err.status
    except (StreamTerminatedError, ProtocolError) as err:
        return err
    finally:
        channel.close()
    return None


def first_status(cluster: Cluster, ctx: ssl.SSLContext, msg: v1.AgentMessage) -> Any:
    return asyncio.run(_first_status(cluster.grpc_port, ctx, msg))


def registered_at(cluster: Cluster, node_id: str) -> str:
    node = cluster.node(node_id)
    assert node is not None
    return str(node["registered"])


def test_certificates_without_an_identity_cannot_take_a_real_nodes_place(
    cluster: Cluster,
) -> None:
    cluster.start_control([{"name": "chat", "profiles": {"default": vllm_profile(gpus=1)}}])
    cluster.start_agent("gpu-a", gpus=2)
    cluster.wait_node_state("gpu-a", "READY")
    cluster.wait_replicas("chat", 1)
    since = registered_at(cluster, "gpu-a")

    odd = cluster.workdir / "odd-certs"
    cases = {
        "no-cn": [name_attr(ORG, "llmgw"), name_attr(OU, "node")],
        "no-ou": [name_attr(ORG, "llmgw"), name_attr(CN, "gpu-a")],
        "spiffe": [name_attr(ORG, "llmgw")],
    }
    for stem, subject in cases.items():
        uris = ("spiffe://llmgw/node/gpu-a",) if stem == "spiffe" else ()
        files = sign_client(cluster.certs, odd, stem, subject, uris=uris)
        ctx = client_context(files.cert, files.key, files.ca)
        for claim in ("gpu-a", "invented-node"):
            register = v1.AgentMessage(register=v1.Register(node_id=claim))
            status = first_status(cluster, ctx, register)
            assert status == grpclib.const.Status.PERMISSION_DENIED, (stem, claim, status)

    # The real gpu-a kept its stream (never "replaced by a newer stream") and its replica.
    assert registered_at(cluster, "gpu-a") == since
    assert [n["node_id"] for n in cluster.status()["nodes"]] == ["gpu-a"]
    assert cluster.wait_node_state("gpu-a", "READY")
    assert [r["state"] for r in cluster.replicas("chat")] == ["ready"]
    assert cluster.control is not None
    log = cluster.control.output()
    assert "newer stream replaces older" not in log
    assert "unreadable certificate identity" in log
    text = cluster.metrics()
    assert metric_sum(text, "llmgw_control_refusals_total", stream="agent") >= 6


def test_oversized_and_overfull_registrations_are_refused(cluster: Cluster) -> None:
    cluster.start_control([{"name": "chat", "profiles": {"default": vllm_profile(gpus=1)}}])
    cluster.start_agent("gpu-a", gpus=1)
    cluster.wait_node_state("gpu-a", "READY")

    # 16 MiB from a valid node certificate: refused from its length prefix.
    tls = cluster.node_cert("gpu-big")
    ctx = client_context(Path(tls["cert"]), Path(tls["key"]), Path(tls["ca"]))
    big = v1.AgentMessage(register=v1.Register(node_id="gpu-big", labels={"b": "x" * 16 * MiB}))
    assert first_status(cluster, ctx, big) == grpclib.const.Status.RESOURCE_EXHAUSTED

    # A real agent configured with thousands of labels: its Register is refused, naming them.
    cluster.start_agent("gpu-l", gpus=1, labels={f"k{i}": "v" for i in range(3000)})
    assert cluster.control is not None
    control = cluster.control
    wait_for(
        lambda: "labels: 3000 labels, at most 64" in control.output(),
        timeout=60,
        what="the overfull Register refused",
    )
    refused_agent = cluster.agents["gpu-l"]
    wait_for(
        lambda: "labels: 3000 labels, at most 64" in refused_agent.output(),
        timeout=60,
        what="the agent told why",
    )
    status = cluster.status()
    assert [n["node_id"] for n in status["nodes"]] == ["gpu-a"]
    store = sum(
        f.stat().st_size for f in (cluster.workdir / "control-state").rglob("*") if f.is_file()
    )
    assert store < 2 * MiB, f"the store holds {store} bytes"
    text = cluster.metrics()
    assert metric_sum(text, "llmgw_control_refusals_total", reason="too large") >= 2
