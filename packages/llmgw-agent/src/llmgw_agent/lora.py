"""LoRA adapters on the node's engines: LoadAdapter and UnloadAdapter (issue 30).

Each command is carried out through the engine's own runtime API, on loopback, with the
engine's secret:

- vLLM: ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` and
  ``POST /v1/unload_lora_adapter {"lora_name"}`` (the engine must run with
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, which the catalog sets with ``lora``).
- SGLang: ``POST /load_lora_adapter`` and ``/unload_lora_adapter``, same bodies.
- llama-server cannot load an adapter at runtime (``--lora`` at start only; its
  ``/lora-adapters`` sets only the scales of those): the command fails and says so.

The answer (a CommandResult) goes up once the engine has answered. What each engine
holds is remembered per engine process and carried in its load reports
(EngineLoad.adapters); a restarted engine holds none.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
from llmgw_proto import v1

from llmgw_agent.probe import http_post

__all__ = ["AdapterCommands", "EngineTarget", "runtime_api"]

log = structlog.get_logger(__name__)

K = v1.EngineKind


@dataclass(frozen=True)
class EngineTarget:
    """A serving engine, as the adapter commands need it."""

    kind: v1.EngineKind
    # The engine's HTTP base URL on this node, e.g. http://127.0.0.1:20001.
    base_url: str
    api_key: str
    # Changes with each engine process: what it held is gone with it.
    generation: int


def runtime_api(kind: v1.EngineKind) -> tuple[str, str] | None:
    """The engine's (load, unload) paths; None for an engine that cannot load at runtime."""
    if kind == K.VLLM:
        return "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
    if kind == K.SGLANG:
        return "/load_lora_adapter", "/unload_lora_adapter"
    return None


def _said(body: bytes, *words: str) -> bool:
    text = body.decode(errors="replace").lower()
    return any(w in text for w in words)


@dataclass
class AdapterCommands:
    # The serving engine of a shard (None: no such engine, or not serving).
    lookup: Callable[[str], EngineTarget | None]
    timeout: float = 120.0
    # shard id -> (engine generation, adapters it holds).
    held: dict[str, tuple[int, set[str]]] = field(default_factory=dict)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def adapters(self, shard_id: str, generation: int) -> list[str]:
        """What the engine of ``shard_id`` holds (its process ``generation``)."""
        entry = self.held.get(shard_id)
        if entry is None or entry[0] != generation:
            return []
        return sorted(entry[1])

    def submit(self, message: v1.ControlMessage, reply: Callable[[v1.CommandResult], None]) -> None:
        """Carry out a LoadAdapter or UnloadAdapter; ``reply`` gets its result later."""
        task = asyncio.get_running_loop().create_task(self._run(message, reply))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(
        self, message: v1.ControlMessage, reply: Callable[[v1.CommandResult], None]
    ) -> None:
        load = message.load_adapter
        command = load or message.unload_adapter
        assert command is not None
        try:
            error = await self.carry_out(
                command.shard_id, command.name, load.source if load is not None else None
            )
        except Exception as err:  # an answer always goes up
            error = f"{type(err).__name__}: {err}"
        kind = "load" if load is not None else "unload"
        if error:
            log.warning(
                f"adapter {kind} failed", shard=command.shard_id, adapter=command.name, error=error
            )
        else:
            log.info(f"adapter {kind}ed", shard=command.shard_id, adapter=command.name)
        reply(v1.CommandResult(command_id=command.command_id, ok=not error, error=error))

    async def carry_out(self, shard_id: str, name: str, source: str | None) -> str:
        """Load (``source`` given) or unload ``name``; "" when done, else why not."""
        target = self.lookup(shard_id)
        if target is None:
            return f"no serving engine for shard {shard_id}"
        api = runtime_api(target.kind)
        if api is None:
            return (
                "llama-server cannot load or unload LoRA adapters at runtime: it takes them "
                "at start (--lora) and only scales them at runtime (POST /lora-adapters)"
            )
        entry = self.held.get(shard_id)
        if entry is None or entry[0] != target.generation:
            entry = self.held[shard_id] = (target.generation, set())
        held = entry[1]
        if source is not None:
            body = json.dumps({"lora_name": name, "lora_path": source}).encode()
            path = api[0]
        else:
            body = json.dumps({"lora_name": name}).encode()
            path = api[1]
        try:
            status, answer = await http_post(
                target.base_url + path, body, timeout=self.timeout, api_key=target.api_key
            )
        except (OSError, TimeoutError) as err:
            return f"engine at {target.base_url} did not answer {path}: {err or type(err).__name__}"
        if source is not None:
            if status == 200 or (
                status == 400 and _said(answer, "already been loaded", "already loaded")
            ):
                held.add(name)
                return ""
        else:
            if status == 200 or (
                status in (400, 404) and _said(answer, "cannot be found", "not found", "not loaded")
            ):
                held.discard(name)
                return ""
        text = answer.decode(errors="replace").strip()[:500]
        return f"{path} answered {status}: {text}"
