"""The agent and a highly available control plane: fencing, standbys, refusals."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from llmgw_agent.agent import Agent
from llmgw_agent.config import AgentConfig
from llmgw_proto import v1
from llmgw_proto.logs import setup_logging
from llmgw_testkit import free_port, wait_for_async

S = v1.ShardState


async def until(condition: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    async def check() -> Any:
        return condition()

    return await wait_for_async(check, timeout=timeout, what=what)


@contextlib.asynccontextmanager
async def running(agent: Agent) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)


def insecure(*addresses: str) -> dict[str, Any]:
    return {"address": addresses[0], "addresses": list(addresses), "tls": {"insecure": True}}


async def test_commands_from_an_older_epoch_are_refused_and_never_acted_on(
    kit: Any, control: Any, make_config: Callable[..., AgentConfig]
) -> None:
    control.epoch = 5
    agent = Agent(make_config(control=insecure(f"127.0.0.1:{control.port}")))
    async with running(agent):
        [register] = await until(control.registers, "Register")
        # Register says which engines the node has, as the engines themselves report.
        kinds = {e.kind: e for e in register.engines}
        assert set(kinds) == {v1.EngineKind.VLLM, v1.EngineKind.SGLANG, v1.EngineKind.LLAMACPP}
        assert kinds[v1.EngineKind.VLLM].version == "0.32.0"
        assert kinds[v1.EngineKind.LLAMACPP].version == "b11434"
        assert all(not e.error for e in register.engines)

        old = kit.make_start(command_id="old", shard_id="old-0", port=free_port(), epoch=3)
        control.send(v1.ControlMessage(start_shard=old))
        stop = v1.StopShard(command_id="old-stop", shard_id="x-0", epoch=4)
        control.send(v1.ControlMessage(stop_shard=stop))
        # A newer leader (epoch 6) is obeyed; its command fails validation on its own merits.
        newer = kit.make_start(command_id="new", shard_id="new-0", engine_args=["--nope"], epoch=6)
        control.send(v1.ControlMessage(start_shard=newer))
        # ...and from then on epoch 5 counts as deposed too.
        five = v1.DrainShard(command_id="five", shard_id="new-0", epoch=5)
        control.send(v1.ControlMessage(drain_shard=five))
        results = await until(lambda: len(control.results()) >= 4 and control.results(), "results")
        by_id = {r.command_id: r for r in results}
        assert not by_id["old"].ok
        assert by_id["old"].error == (
            "refused: command from leader epoch 3, older than epoch 5 already seen "
            "(a deposed leader)"
        )
        assert not by_id["old-stop"].ok
        assert "epoch 4, older than epoch 5" in by_id["old-stop"].error
        assert not by_id["new"].ok
        assert "unknown engine argument '--nope'" in by_id["new"].error
        assert not by_id["five"].ok
        assert "epoch 5, older than epoch 6" in by_id["five"].error
        # The fenced start never even reached validation.
        assert [s for s in control.statuses() if s.shard_id == "old-0"] == []
        assert agent.link.epoch == 6


async def test_a_standby_sends_the_agent_to_the_leader(
    kit: Any, make_config: Callable[..., AgentConfig]
) -> None:
    leader = kit.FakeControl(free_port())
    standby = kit.FakeControl(free_port())
    standby.standby_for = f"127.0.0.1:{leader.port}"
    await leader.start()
    await standby.start()
    try:
        # Only the standby is configured: its answer names the leader.
        agent = Agent(make_config(control=insecure(f"127.0.0.1:{standby.port}")))
        async with running(agent):
            [register] = await until(leader.registers, "Register at the leader")
            assert register.node_id == "node-a"
            assert standby.refused >= 1
            assert standby.registers() == []
            assert agent.link.address == f"127.0.0.1:{leader.port}"
    finally:
        await standby.stop()
        await leader.stop()


async def test_several_addresses_are_tried_in_turn(
    kit: Any, control: Any, make_config: Callable[..., AgentConfig]
) -> None:
    nothing = f"127.0.0.1:{free_port()}"  # no control plane listens here
    agent = Agent(make_config(control=insecure(nothing, f"127.0.0.1:{control.port}")))
    async with running(agent):
        await until(control.registers, "Register at the second address")
        assert agent.link.address == f"127.0.0.1:{control.port}"


async def test_permission_denied_is_logged_once_and_retried_at_the_longest_backoff(
    control: Any, make_config: Callable[..., AgentConfig]
) -> None:
    control.deny = True
    agent = Agent(make_config(control=insecure(f"127.0.0.1:{control.port}"), max_backoff="1s"))
    # Through the program's own logging, as a user reads it: structlog's capture_logs
    # misses a logger that an earlier test in this worker cached under another
    # configuration (cache_logger_on_first_use), and such a logger still ends here.
    out = io.StringIO()
    setup_logging("info", "json", stream=out)
    async with running(agent):
        await until(lambda: control.refused >= 3, "three refused attempts")
    lines = [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]
    refusals = [e for e in lines if "PERMISSION_DENIED" in e["event"]]
    assert len(refusals) == 1, lines
    assert refusals[0]["level"] == "error"
    assert refusals[0]["node"] == "node-a"
    # Every retry after a refusal waits the maximum backoff, not the short first delays.
    assert agent.link.delays[:2] == [1.0, 1.0]
