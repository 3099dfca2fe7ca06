"""LoRA adapter commands against real simulated engines (issue 30): the agent calls each
engine's own runtime API, on its port, with its secret, and remembers what it holds."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from llmgw_agent.adapters import adapter_for
from llmgw_agent.load import LoadReporter, LoadSource
from llmgw_agent.lora import AdapterCommands, EngineTarget
from llmgw_proto import v1
from llmgw_sim.testing import start

K = v1.EngineKind
ENGINES = {
    "vllm": (
        K.VLLM,
        ["--enable-lora", "--max-loras", "2", "--api-key", "s3cret"],
        {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    ),
    "sglang": (
        K.SGLANG,
        ["--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "all"],
        {},
    ),
}


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_load_and_unload_through_the_engines_api(tmp_path: Path, kind: str) -> None:
    engine, args, env = ENGINES[kind]
    key = "s3cret" if kind == "vllm" else ""
    with start(tmp_path, kind, args, env=env) as sim:
        target = EngineTarget(engine, sim.url, key, generation=7)
        commands = AdapterCommands(lambda shard: target if shard == "s1" else None)

        async def run() -> None:
            assert await commands.carry_out("s1", "sql", "/loras/sql") == ""
            # Again: the engine says it has it already, which is what was wanted.
            assert await commands.carry_out("s1", "sql", "/loras/sql") == ""
            assert await commands.carry_out("s1", "chat", "/loras/chat") == ""
            assert commands.adapters("s1", 7) == ["chat", "sql"]
            # Another engine process behind the shard holds nothing of the last one's.
            assert commands.adapters("s1", 8) == []
            assert await commands.carry_out("s1", "sql", None) == ""
            assert commands.adapters("s1", 7) == ["chat"]
            assert "no serving engine" in await commands.carry_out("s2", "x", "/p")

        asyncio.run(run())


def test_vllm_without_runtime_updating_is_an_error_that_says_what_the_engine_said(
    tmp_path: Path,
) -> None:
    with start(tmp_path, "vllm", ["--enable-lora"]) as sim:
        target = EngineTarget(K.VLLM, sim.url, "", generation=1)
        commands = AdapterCommands(lambda shard: target)
        error = asyncio.run(commands.carry_out("s1", "sql", "/p"))
        assert error.startswith("/v1/load_lora_adapter answered 404"), error
        assert commands.adapters("s1", 1) == []


def test_llama_server_cannot_load_at_runtime() -> None:
    target = EngineTarget(K.LLAMACPP, "http://127.0.0.1:9", "", generation=1)
    error = asyncio.run(AdapterCommands(lambda s: target).carry_out("s1", "sql", "/p"))
    assert "llama-server cannot load" in error


def test_load_reports_carry_what_the_engine_holds(tmp_path: Path) -> None:
    engine, args, env = ENGINES["vllm"]
    with start(tmp_path, "vllm", args, env=env) as sim:
        target = EngineTarget(engine, sim.url, "s3cret", generation=5)
        commands = AdapterCommands(lambda shard: target)
        adapter = adapter_for(K.VLLM)
        assert adapter is not None
        source = LoadSource("s1", sim.url + "/metrics", adapter.load, 5, api_key="s3cret")
        sent: list[v1.LoadReport] = []
        reporter = LoadReporter(
            lambda: [source],
            sent.append,
            interval=lambda: 0.25,
            session=lambda: 1,
            adapters=commands.adapters,
        )

        async def run() -> None:
            first = await reporter.round()
            assert first is not None
            assert first.engines[0].adapters == []
            assert await commands.carry_out("s1", "sql", "/p") == ""
            # The figures are the same; what the engine holds changed: it goes up.
            second = await reporter.round()
            assert second is not None
            assert second.engines[0].adapters == ["sql"]

        asyncio.run(run())
