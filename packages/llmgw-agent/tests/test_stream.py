"""The control stream against a scripted control plane on a real grpclib server."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import random
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_agent.agent import Agent
from llmgw_agent.config import AgentConfig
from llmgw_agent.stream import ControlLink, Outbox
from llmgw_agent.supervisor import process_start_ticks
from llmgw_proto import v1
from llmgw_proto.backoff import Backoff, exponential
from llmgw_proto.tls import server_context
from llmgw_testkit import free_port, wait_for_async

S = v1.ShardState


def _common_name(peer_cert: dict[str, Any] | None) -> str:
    """The subject's CN as the server saw it ("" for none). These test certificates have
    no OU, so the control plane's read_identity would refuse them; here only the
    certificate's arrival is checked."""
    for rdn in (peer_cert or {}).get("subject", ()):
        for attr, value in rdn:
            if attr == "commonName":
                return str(value)
    return ""


async def until(condition: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    async def check() -> Any:
        return condition()

    return await wait_for_async(check, timeout=timeout, what=what)


class NoCommands:
    """A command handler for links that never get a command."""

    def start(self, start: v1.StartShard) -> v1.CommandResult:
        raise AssertionError("unexpected command")

    def stop(self, stop: v1.StopShard) -> v1.CommandResult:
        raise AssertionError("unexpected command")

    def drain(self, drain: v1.DrainShard) -> v1.CommandResult:
        raise AssertionError("unexpected command")


@contextlib.asynccontextmanager
async def running(agent: Agent) -> AsyncIterator[asyncio.Event]:
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        yield stop
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)


async def test_register_heartbeats_commands_and_statuses(
    kit: Any, control: Any, make_config: Callable[..., AgentConfig], reap: list[int]
) -> None:
    config = make_config(
        control={"address": f"127.0.0.1:{control.port}", "tls": {"insecure": True}},
        stop_engines_on_exit=True,
    )
    agent = Agent(config)
    async with running(agent):
        [register] = await until(control.registers, "Register")
        assert register.node_id == "node-a"
        assert register.labels == {"fabric.nvlink-domain": "nvl-1"}
        inventory = register.inventory
        assert inventory is not None
        assert inventory.simulated
        assert [g.name for g in inventory.gpus] == ["NVIDIA H200"] * 4
        assert inventory.host is not None
        assert inventory.host.cpu_count >= 1
        assert any(i.name == "lo" and i.addresses[0] == "127.0.0.1" for i in inventory.interfaces)
        assert register.shards == []
        # Heartbeats at the interval RegisterAck gave (0.2 s), numbered.
        beats = await until(
            lambda: len(control.heartbeats()) >= 3 and control.heartbeats(), "heartbeats"
        )
        assert [b.sequence for b in beats[:3]] == [1, 2, 3]
        assert [g.index for g in beats[0].gpus] == [0, 1, 2, 3]
        assert beats[0].sent_at is not None

        port = free_port()
        control.send(
            v1.ControlMessage(
                start_shard=kit.make_start(command_id="c1", port=port, gpu_indices=[0, 1])
            )
        )
        control.send(
            v1.ControlMessage(
                start_shard=kit.make_start(
                    command_id="c2", shard_id="bad-0", engine_args=["--nope"]
                )
            )
        )
        ready = await until(lambda: [s for s in control.statuses() if s.state == S.READY], "READY")
        reap.append(ready[0].pid)
        assert ready[0].endpoint_url == f"http://127.0.0.1:{port}"
        results = await until(
            lambda: len(control.results()) >= 2 and control.results(), "two results"
        )
        by_id = {r.command_id: r for r in results}
        assert by_id["c1"].ok
        assert not by_id["c2"].ok
        assert "unknown engine argument '--nope'" in by_id["c2"].error
        shard = "qwen.fast.0123abcd-0"
        assert [s.state for s in control.statuses() if s.shard_id == shard] == [
            S.VALIDATING,
            S.STARTING,
            S.READY,
        ]
        assert [s.state for s in control.statuses() if s.shard_id == "bad-0"] == [
            S.VALIDATING,
            S.FAILED,
        ]

        control.send(v1.ControlMessage(stop_shard=v1.StopShard(command_id="c3", shard_id=shard)))
        control.send(
            v1.ControlMessage(stop_shard=v1.StopShard(command_id="c4", shard_id="never-0"))
        )
        await until(lambda: [s for s in control.statuses() if s.state == S.STOPPED], "STOPPED")
        results = await until(
            lambda: len(control.results()) >= 4 and control.results(), "four results"
        )
        by_id = {r.command_id: r for r in results}
        assert by_id["c3"].ok
        assert by_id["c3"].error == ""
        assert by_id["c4"].ok
        assert by_id["c4"].error == "shard never-0 is not running"


async def test_reconnect_delivers_what_happened_meanwhile(
    kit: Any, control: Any, make_config: Callable[..., AgentConfig], reap: list[int]
) -> None:
    config = make_config(
        control={"address": f"127.0.0.1:{control.port}", "tls": {"insecure": True}},
        stop_engines_on_exit=True,
    )
    agent = Agent(config)
    async with running(agent):
        await until(control.registers, "first Register")
        # Starts now, crashes after 2 s: while the control plane is away.
        control.send(
            v1.ControlMessage(
                start_shard=kit.make_start(
                    command_id="c1", port=free_port(), env={"SIM_EXIT_AFTER": "2", "SIM_EXIT": "7"}
                )
            )
        )
        starting = await until(
            lambda: [s for s in control.statuses() if s.state == S.STARTING], "STARTING"
        )
        reap.append(starting[0].pid)
        await control.stop()
        await until(lambda: not agent.link.connected.is_set(), "agent to notice")
        # The engine crashes with nobody listening; the agent keeps the news.
        await until(
            lambda: any(
                m.shard_status and m.shard_status.state == S.FAILED for m in agent.outbox._items
            ),
            "FAILED queued",
        )
        await control.start()  # the control plane is back, on the same address
        registers = await until(
            lambda: len(control.registers()) >= 2 and control.registers(), "second Register"
        )
        assert registers[1].node_id == "node-a"
        later = await until(
            lambda: [s for s in control.statuses(1) if s.state == S.FAILED],
            "FAILED after reconnect",
        )
        assert later[0].exit_code == 7
        assert "dying line 59" in later[0].output_tail
        # Register came first on the new stream, the queued status after it.
        assert control.streams[1][0].register is not None
        assert agent.link.sessions == 2
        assert agent.link.delays  # it waited (with backoff) before dialing again


async def test_register_lists_running_shards(
    kit: Any, control: Any, make_config: Callable[..., AgentConfig], reap: list[int]
) -> None:
    config = make_config(
        control={"address": f"127.0.0.1:{control.port}", "tls": {"insecure": True}}
    )
    first = Agent(config)
    async with running(first):
        await until(control.registers, "Register")
        control.send(
            v1.ControlMessage(
                start_shard=kit.make_start(command_id="c1", port=free_port(), gpu_indices=[2])
            )
        )
        ready = await until(lambda: [s for s in control.statuses() if s.state == S.READY], "READY")
        reap.append(ready[0].pid)
    # stop_engines_on_exit is false: the engine outlives the agent, and the next one adopts it.
    second = Agent(config)
    async with running(second):
        registers = await until(
            lambda: len(control.registers()) >= 2 and control.registers(), "second Register"
        )
        [shard] = registers[1].shards
        assert shard.shard_id == "qwen.fast.0123abcd-0"
        assert shard.pid == ready[0].pid
        assert shard.state == S.READY
        assert shard.gpu_indices == [2]
        assert shard.world_size == 1
        assert shard.started_at is not None
        assert shard.endpoint_url == ready[0].endpoint_url
        # Idempotent start for an adopted shard.
        control.send(
            v1.ControlMessage(
                start_shard=kit.make_start(command_id="again", gpu_indices=[2], port=shard.port)
            )
        )
        result = await until(
            lambda: [r for r in control.results() if r.command_id == "again"], "result"
        )
        assert result[0].ok
        assert "already runs" in result[0].error
    # Still running after the second agent went away too.
    assert process_start_ticks(ready[0].pid) is not None


async def test_backoff_grows_while_nobody_listens(make_config: Callable[..., AgentConfig]) -> None:
    port = free_port()  # nothing listens here
    config = make_config(
        control={"address": f"127.0.0.1:{port}", "tls": {"insecure": True}},
        base_backoff="10ms",
        max_backoff="80ms",
    )
    link = ControlLink(
        config,
        handler=NoCommands(),
        outbox=Outbox(),
        register=lambda: v1.Register(node_id="n"),
        usage=list,
        backoff=Backoff(config.base_backoff, config.max_backoff, rng=random.Random(7)),
    )
    task = asyncio.create_task(link.run())
    try:
        await until(lambda: len(link.delays) >= 8, "eight reconnect attempts")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    for attempt, delay in enumerate(link.delays):
        assert 0 <= delay <= exponential(attempt, 0.01, 0.08)
    assert link.sessions == 0


async def test_backoff_resets_after_a_stream_that_stayed_up(
    control: Any, make_config: Callable[..., AgentConfig]
) -> None:
    config = make_config(
        control={"address": f"127.0.0.1:{control.port}", "tls": {"insecure": True}},
        base_backoff="10ms",
        max_backoff="50ms",
        stable_after="300ms",
    )
    backoff = Backoff(config.base_backoff, config.max_backoff, rng=random.Random(1))
    backoff.attempt = 6  # as if many failures came before
    link = ControlLink(
        config,
        handler=NoCommands(),
        outbox=Outbox(),
        register=lambda: v1.Register(node_id="n"),
        usage=list,
        backoff=backoff,
    )
    task = asyncio.create_task(link.run())
    try:
        await until(link.connected.is_set, "connected")
        await asyncio.sleep(0.5)  # let the stream stay up past stable_after
        await control.stop()
        await until(lambda: link.delays, "a reconnect delay")
        # Reset by the stable stream: the first delay comes from attempt 0's window.
        assert link.delays[0] <= 0.01
        await control.start()
        await until(lambda: link.sessions >= 2, "second session")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@settings(max_examples=200)
@given(
    base=st.floats(0.01, 5.0),
    factor=st.floats(1.0, 1000.0),
    failures=st.integers(0, 200),
    seed=st.integers(0, 2**32),
)
def test_backoff_bounds(base: float, factor: float, failures: int, seed: int) -> None:
    cap = base * factor
    backoff = Backoff(base, cap, rng=random.Random(seed))
    for attempt in range(failures):
        delay = backoff.next()
        assert 0.0 <= delay <= min(cap, base * 2.0**attempt) + 1e-9
    assert backoff.next() <= cap + 1e-9


@given(seed=st.integers(0, 2**32), attempt=st.integers(4, 30))
def test_backoff_spreads_a_fleet(seed: int, attempt: int) -> None:
    # 200 agents losing the control plane together draw from the whole window,
    # not in lockstep.
    rng = random.Random(seed)
    cap = 30.0
    delays = []
    for _ in range(200):
        backoff = Backoff(0.5, cap, rng=random.Random(rng.random()))
        backoff.attempt = attempt
        delays.append(backoff.next())
    window = exponential(attempt, 0.5, cap)
    assert len({round(d, 6) for d in delays}) > 150
    assert min(delays) < window * 0.1
    assert max(delays) > window * 0.9
    quarters = [
        sum(1 for d in delays if q * window / 4 <= d < (q + 1) * window / 4) for q in range(4)
    ]
    assert all(n > 20 for n in quarters)


async def test_outbox_keeps_order_and_bounds() -> None:
    outbox = Outbox(limit=3)
    for i in range(5):
        outbox.status(v1.ShardStatus(shard_id=f"s{i}"))
    assert len(outbox) == 3
    assert outbox.dropped == 2
    seen = []
    while (message := outbox.peek()) is not None:
        assert message.shard_status is not None
        seen.append(message.shard_status.shard_id)
        outbox.pop()
    assert seen == ["s2", "s3", "s4"]
    await asyncio.wait_for(outbox.flushed(), 1)
    outbox.put(v1.AgentMessage(heartbeat=v1.Heartbeat()))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(outbox.flushed(), 0.05)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def build(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: str,
    signer: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    san: x509.GeneralName | None = None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName([san]), critical=False)
    return builder.sign(signer, hashes.SHA256())


def _make_certs(directory: Path, node_id: str) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a node client certificate."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    server_key = ec.generate_private_key(ec.SECP256R1())
    node_key = ec.generate_private_key(ec.SECP256R1())
    certs = {
        "ca": build("test CA", ca_key, "test CA", ca_key, ca=True),
        "server": build(
            "control",
            server_key,
            "test CA",
            ca_key,
            san=x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        ),
        "node": build(node_id, node_key, "test CA", ca_key),
    }
    keys = {"ca": ca_key, "server": server_key, "node": node_key}
    paths: dict[str, Path] = {}
    for role, cert in certs.items():
        paths[f"{role}.crt"] = directory / f"{role}.crt"
        paths[f"{role}.crt"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[f"{role}.key"] = directory / f"{role}.key"
        paths[f"{role}.key"].write_bytes(
            keys[role].private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return paths


async def test_mutual_tls(
    kit: Any, tmp_path: Path, make_config: Callable[..., AgentConfig]
) -> None:
    certs = _make_certs(tmp_path, "node-a")
    control = kit.FakeControl(free_port())
    await control.start(server_context(certs["server.crt"], certs["server.key"], certs["ca.crt"]))
    try:
        tls = {
            "cert": str(certs["node.crt"]),
            "key": str(certs["node.key"]),
            "ca": str(certs["ca.crt"]),
        }
        config = make_config(control={"address": f"127.0.0.1:{control.port}", "tls": tls})
        agent = Agent(config)
        async with running(agent):
            [register] = await until(control.registers, "Register over mTLS")
            assert register.node_id == "node-a"
            # The control plane sees the node's certificate: the hook for identity checks.
            assert _common_name(control.peer_certs[0]) == "node-a"
            first_serial = control.peer_certs[0]["serialNumber"]

            # Rotate the node's certificate in place (same CA, new key and serial);
            # the next stream presents the new one.
            ca_key = serialization.load_pem_private_key(certs["ca.key"].read_bytes(), None)
            assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
            new_key = ec.generate_private_key(ec.SECP256R1())
            certs["node.crt"].write_bytes(
                build("node-a", new_key, "test CA", ca_key).public_bytes(serialization.Encoding.PEM)
            )
            certs["node.key"].write_bytes(
                new_key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            )
            await control.stop()
            await control.start(_server_for(certs))
            await until(lambda: control.registers()[1:], "Register after the rotation")
            assert _common_name(control.peer_certs[-1]) == "node-a"
            assert control.peer_certs[-1]["serialNumber"] != first_serial
    finally:
        await control.stop()


def _server_for(certs: dict[str, Path]) -> ssl.SSLContext:
    return server_context(certs["server.crt"], certs["server.key"], certs["ca.crt"])
