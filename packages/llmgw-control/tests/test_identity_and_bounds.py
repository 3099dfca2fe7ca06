"""Issue 24, points 1 and 2, over a real `llmgw-control serve` process and real gRPC.

Certificates whose subject does not say who they are (no CN, no OU, several of either,
an empty CN, a SAN-only SPIFFE identity) are refused with PERMISSION_DENIED while the
real node stays connected; messages larger than ``max_message_bytes`` are refused with
RESOURCE_EXHAUSTED from their length prefix; a node cannot make the control plane keep
an oversized Register, thousands of labels or thousands of invented shards.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpclib.client
import grpclib.const
import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError
from llmgw_control.ca import Issued, init_ca, issue
from llmgw_proto import v1
from llmgw_proto.tls import PeerIdentity, UnreadableIdentity, client_context, read_identity
from llmgw_testkit import wait_for_async
from llmgw_testkit.certs import sign_client

Factory = Callable[..., Any]
MiB = 1024 * 1024
S = v1.ShardState


def model(replicas: int = 0) -> dict[str, Any]:
    return {
        "name": "m",
        "profiles": {"p": {"engine": "vllm", "gpus_per_node": 1, "replicas": replicas}},
    }


async def until(check: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    async def probe() -> Any:
        return check()

    return await wait_for_async(probe, timeout=timeout, interval=0.05, what=what)


def closed(agent: Any) -> Callable[[], Any]:
    return lambda: agent.closed_by_server


def signed(
    ca: Issued,
    out: Path,
    stem: str,
    subject: list[x509.NameAttribute[str]],
    *,
    uris: tuple[str, ...] = (),
) -> ssl.SSLContext:
    """A client certificate the llmgw CA (``llmgw-control ca init``) signed, with any subject."""
    files = sign_client(ca.cert.parent, out, stem, subject, uris=uris)
    return client_context(files.cert, files.key, files.ca)


def attr(oid: x509.ObjectIdentifier, value: str) -> x509.NameAttribute[str]:
    return x509.NameAttribute(oid, value)


ORG = attr(NameOID.ORGANIZATION_NAME, "llmgw")
OU_NODE = attr(NameOID.ORGANIZATIONAL_UNIT_NAME, "node")
CN_GPU_A = attr(NameOID.COMMON_NAME, "gpu-a")


def mtls_control(tmp_path: Path, control_factory: Factory, **control: Any) -> tuple[Any, Issued]:
    ca = init_ca(tmp_path / "ca")
    server = issue(tmp_path / "ca", "server", "control", hosts=["127.0.0.1"], out=tmp_path / "s")
    tls = {"cert": str(server.cert), "key": str(server.key), "ca": str(ca.cert)}
    return control_factory([model()], tls=tls, **control), ca


def as_node(tmp_path: Path, name: str) -> ssl.SSLContext:
    node = issue(tmp_path / "ca", "node", name, out=tmp_path / "n")
    return client_context(node.cert, node.key, tmp_path / "ca" / "ca.crt")


def refusals(metrics: str, stream: str, reason: str) -> float:
    total = 0.0
    for line in metrics.splitlines():
        if (
            line.startswith("llmgw_control_refusals_total{")
            and f'stream="{stream}"' in line
            and f'reason="{reason}"' in line
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def metrics(control: Any) -> str:
    code, body = await control.get("/metrics")
    assert code == 200
    return str(body)


async def test_certificates_that_do_not_say_who_they_are_are_refused(
    tmp_path: Path, control_factory: Factory, agent_factory: Factory
) -> None:
    control, ca = mtls_control(tmp_path, control_factory)
    honest = agent_factory(control.grpc_port, "gpu-a", ssl=as_node(tmp_path, "gpu-a"))
    honest.start()
    await until(honest.connected.is_set, "the real gpu-a registered over mTLS")

    odd = tmp_path / "odd"
    cn = NameOID.COMMON_NAME
    ou = NameOID.ORGANIZATIONAL_UNIT_NAME
    impostors = {
        # The reported attack: OU=node and no CN, claiming gpu-a and an invented node.
        "no CN, as gpu-a": ("gpu-a", [ORG, OU_NODE]),
        "no CN, as an undeclared node": ("nobody", [ORG, OU_NODE]),
        "CN but no OU": ("gpu-a", [ORG, CN_GPU_A]),
        "two CNs": ("gpu-a", [ORG, OU_NODE, CN_GPU_A, attr(cn, "gpu-b")]),
        "two OUs": ("gpu-a", [ORG, OU_NODE, attr(ou, "router"), CN_GPU_A]),
        "unknown OU": ("gpu-a", [ORG, attr(ou, "superuser"), CN_GPU_A]),
        "blank CN": ("gpu-a", [ORG, OU_NODE, attr(cn, " ")]),
    }
    agents = {}
    for i, (what, (claim, subject)) in enumerate(impostors.items()):
        ctx = signed(ca, odd, f"odd-{i}", subject)
        agents[what] = agent_factory(control.grpc_port, claim, ssl=ctx)
    # SAN-only, SPIFFE style: a URI SAN names a node, the subject names nobody.
    spiffe = signed(ca, odd, "spiffe", [ORG], uris=("spiffe://llmgw/node/gpu-a",))
    agents["SAN-only (SPIFFE)"] = agent_factory(control.grpc_port, "gpu-a", ssl=spiffe)
    for agent in agents.values():
        agent.start()
    for what, agent in agents.items():
        await until(closed(agent), f"{what}: refused")
        assert "PERMISSION_DENIED" in agent.closed_by_server[0], (what, agent.closed_by_server)
        assert "unreadable certificate identity" in agent.closed_by_server[0], what
        assert not agent.acks, f"{what}: got a RegisterAck"

    # EndpointService too: a router name without OU=router is nobody.
    no_ou_router = signed(ca, odd, "router-no-ou", [ORG, attr(cn, "edge-1")])
    demand = v1.DemandRequest(router_id="edge-1", model="m")
    status = await send_first(control.grpc_port, no_ou_router, demand, DEMAND)
    assert status == grpclib.const.Status.PERMISSION_DENIED

    # The real node was never replaced: one stream, still open, the only node known.
    assert honest.connected.is_set()
    assert honest.closed_by_server == []
    assert len(honest.acks) == 1
    status = await control.status()
    assert [(n["node_id"], n["state"]) for n in status["nodes"]] == [("gpu-a", "READY")]
    text = await metrics(control)
    assert refusals(text, "agent", "identity") >= len(agents)
    assert refusals(text, "watch", "identity") == 1
    log = control.proc.output()
    assert "no common name" in log
    assert "spiffe://llmgw/node/gpu-a" in log
    assert '"peer": "127.0.0.1"' in log, "refusals are logged with the peer"


async def test_a_router_certificate_cannot_send_a_huge_first_message(
    tmp_path: Path, control_factory: Factory
) -> None:
    """Refused on its identity before the message is read (it is 48 MiB)."""
    control, ca = mtls_control(tmp_path, control_factory)
    router = issue(tmp_path / "ca", "router", "edge-1", out=tmp_path / "r")
    ctx = client_context(router.cert, router.key, ca.cert)
    huge = v1.AgentMessage(register=v1.Register(node_id="edge-1", labels={"x": "y" * (48 * MiB)}))
    before = peak_rss(control)
    status = await send_first(control.grpc_port, ctx, huge)
    assert status == grpclib.const.Status.PERMISSION_DENIED
    # Not read: the control plane's peak memory did not take the 48 MiB (at most one
    # HTTP/2 window, 4 MiB, is in flight before the refusal).
    grew = peak_rss(control) - before
    assert grew < 24 * MiB, f"peak RSS grew by {grew / MiB:.1f} MiB"


CONNECT = (
    "/llmgw.v1.AgentService/Connect",
    grpclib.const.Cardinality.STREAM_STREAM,
    v1.AgentMessage,
    v1.ControlMessage,
)
DEMAND = (
    "/llmgw.v1.EndpointService/ReportDemand",
    grpclib.const.Cardinality.UNARY_UNARY,
    v1.DemandRequest,
    v1.DemandReply,
)


async def send_first(
    port: int, ctx: ssl.SSLContext | None, msg: Any, call: tuple[Any, ...] = CONNECT
) -> Any:
    """Open a call (AgentService/Connect by default), send ``msg``; the status it ends with."""
    channel = grpclib.client.Channel("127.0.0.1", port, ssl=ctx)
    stream = channel.request(*call)
    try:
        async with asyncio.timeout(120), stream:
            await stream.send_request()
            # A large message waits on flow control: the answer may come first.
            sending = asyncio.create_task(stream.send_message(msg))
            try:
                first = await stream.recv_message()
            except StreamTerminatedError:
                first = None  # the stream was reset: its status is read on leaving
            finally:
                sending.cancel()
                with contextlib.suppress(BaseException):
                    await sending
            if first is not None:
                if call[1] != grpclib.const.Cardinality.UNARY_UNARY:
                    await stream.cancel()
                return grpclib.const.Status.OK
    except GRPCError as err:
        return err.status
    except (StreamTerminatedError, ProtocolError) as err:
        return err
    finally:
        channel.close()
    return None


def peak_rss(control: Any) -> int:
    """The control plane process's peak resident memory so far (VmHWM), in bytes."""
    for line in Path(f"/proc/{control.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/PID/status")


def state_bytes(tmp_path: Path) -> int:
    return sum(f.stat().st_size for f in (tmp_path / "control-state").rglob("*") if f.is_file())


async def test_messages_over_the_bound_are_refused_from_their_prefix(
    tmp_path: Path, control_factory: Factory, agent_factory: Factory
) -> None:
    control, ca = mtls_control(tmp_path, control_factory)
    honest = agent_factory(control.grpc_port, "gpu-a", ssl=as_node(tmp_path, "gpu-a"))
    honest.start()
    await until(honest.connected.is_set, "the real gpu-a registered")

    # A node's own certificate, a 16 MiB Register (the limit is 4 MiB).
    big = v1.AgentMessage(
        register=v1.Register(node_id="gpu-big", labels={"blob": "x" * (16 * MiB)})
    )
    before = peak_rss(control)
    status = await send_first(control.grpc_port, as_node(tmp_path, "gpu-big"), big)
    assert status == grpclib.const.Status.RESOURCE_EXHAUSTED
    grew = peak_rss(control) - before
    assert grew < 24 * MiB, f"peak RSS grew by {grew / MiB:.1f} MiB: the 16 MiB was read"
    # A router's 5 MiB ReportDemand, on the other service.
    router = issue(tmp_path / "ca", "router", "edge-1", out=tmp_path / "r")
    demand = v1.DemandRequest(router_id="edge-1", model="m" * (5 * MiB))
    status = await send_first(
        control.grpc_port, client_context(router.cert, router.key, ca.cert), demand, DEMAND
    )
    assert status == grpclib.const.Status.RESOURCE_EXHAUSTED
    # Just under the bound still goes through (and is then bounded by what a node may say).
    fits = v1.DemandRequest(router_id="edge-1", model="m" * (3 * MiB))
    status = await send_first(
        control.grpc_port, client_context(router.cert, router.key, ca.cert), fits, DEMAND
    )
    assert status == grpclib.const.Status.OK

    state = await control.status()
    assert [n["node_id"] for n in state["nodes"]] == ["gpu-a"]
    assert state_bytes(tmp_path) < 2 * MiB, "the store did not take the 16 MiB Register"
    assert honest.connected.is_set()
    assert honest.closed_by_server == []
    text = await metrics(control)
    assert refusals(text, "agent", "too large") == 1
    assert refusals(text, "reportdemand", "too large") == 1
    log = control.proc.output()
    assert "gRPC message refused: too large" in log
    assert "node gpu-big" in log
    assert "router edge-1" in log
    assert "limit=4194304" in log or '"limit": 4194304' in log


async def test_what_one_node_may_report_is_bounded(
    tmp_path: Path, control_factory: Factory, agent_factory: Factory
) -> None:
    control, _ = mtls_control(tmp_path, control_factory)
    # Thousands of labels (a small message, but not a node's description).
    many = agent_factory(
        control.grpc_port,
        "gpu-labels",
        ssl=as_node(tmp_path, "gpu-labels"),
        labels={f"k{i}": "v" for i in range(3000)},
    )
    # One huge label value.
    long = agent_factory(
        control.grpc_port,
        "gpu-long",
        ssl=as_node(tmp_path, "gpu-long"),
        labels={"note": "v" * 100_000},
    )
    # Thousands of shards in the Register.
    crowded = agent_factory(control.grpc_port, "gpu-crowd", ssl=as_node(tmp_path, "gpu-crowd"))
    for i in range(3000):
        crowded.running[f"s{i}"] = v1.RunningShard(
            shard_id=f"s{i}", replica_id=f"r{i}", model="m", profile="p", state=S.READY
        )
    for agent in (many, long, crowded):
        agent.start()
    for agent, why in (
        (many, "labels: 3000 labels, at most 64"),
        (long, "value of 100000 characters, at most 1024"),
        (crowded, "shards: 3000 shards reported, at most 256"),
    ):
        await until(closed(agent), f"{agent.node_id} refused")
        assert "RESOURCE_EXHAUSTED" in agent.closed_by_server[0], agent.closed_by_server
        assert why in agent.closed_by_server[0]
        assert not agent.acks

    # A node that registers fine, then reports 3,000 invented READY shards and a huge reason.
    node = agent_factory(control.grpc_port, "gpu-b", ssl=as_node(tmp_path, "gpu-b"))
    node.start()
    await until(node.connected.is_set, "gpu-b registered")
    # Not a status any node could mean: a 5,000-character id, 100,000 GPU indices.
    await node.status(node.stream, "i" * 5000, "r", S.READY)
    await node.status(node.stream, "gpus", "r", S.READY, gpu_indices=list(range(100_000)))
    for i in range(3000):
        await node.status(node.stream, f"invented-{i}", f"r{i}", S.READY)
    await node.status(node.stream, "last", "r-last", S.FAILED, reason="why " * 100_000)
    await until(
        lambda: refusals_seen(control) >= 3000 - 256 + 1,
        "the invented shards dropped past the bound",
    )
    state = await control.status()
    gpu_b = next(n for n in state["nodes"] if n["node_id"] == "gpu-b")
    assert gpu_b["shards"] == 256
    assert node.connected.is_set(), "the stream stays: the node is bounded, not cut off"
    assert [n["node_id"] for n in state["nodes"]] == ["gpu-b"]
    assert refusals(await metrics(control), "agent", "shard status too large") == 2
    log = control.proc.output()
    assert "shard status dropped" in log
    assert "gpu_indices: 100000 indices, at most 256" in log
    assert log.count("shard status dropped") < 10, "one warning per thousand, not per status"


def refusals_seen(control: Any) -> float:
    """The dropped shard statuses counted so far (read through the admin API)."""
    with urllib.request.urlopen(control.admin + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return refusals(text, "agent", "shard not asked for")


def decoded(ctx_dir: Path, stem: str) -> dict[str, object]:
    """The certificate as ``getpeercert()`` shows it (CPython's own decoder)."""
    return ssl._ssl._test_decode_cert(str(ctx_dir / f"{stem}.crt"))  # type: ignore[attr-defined,no-any-return]


def test_identity_of_certificates_from_the_projects_ca(tmp_path: Path) -> None:
    ca = init_ca(tmp_path / "ca")
    node = issue(tmp_path / "ca", "node", "gpu-a", out=tmp_path / "n")
    assert read_identity(ssl._ssl._test_decode_cert(str(node.cert))) == PeerIdentity(  # type: ignore[attr-defined]
        "node", "gpu-a"
    )
    odd = tmp_path / "odd"
    signed(ca, odd, "no-cn", [ORG, OU_NODE])
    signed(ca, odd, "no-ou", [ORG, CN_GPU_A])
    signed(ca, odd, "spiffe", [ORG], uris=("spiffe://llmgw/node/gpu-a",))
    for stem, why in (
        ("no-cn", "no common name"),
        ("no-ou", "no organizational unit"),
        ("spiffe", "URI SAN 'spiffe://llmgw/node/gpu-a' is not an llmgw identity"),
    ):
        with pytest.raises(UnreadableIdentity, match=why):
            read_identity(decoded(odd, stem))
