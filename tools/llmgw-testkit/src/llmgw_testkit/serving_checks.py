"""The serving checks the real-engine suites share (tests-real-engine: llama.cpp's
llama-server; tests-real-vllm: vLLM, or SGLang): one real engine, placed on a CPU node by
the control plane, launched by the agent, served through the router.

Each check takes the running system and the served model's name, asserts what every real
engine must show, and returns what it read so that a suite adds its engine's own checks
(vLLM names the model it serves as asked, llama.cpp by its file; the wording of a 401...).
The model is a small base model: the checks look at shapes, usage and token counts, never
at the text. They need ``openai`` and ``httpx`` (tools/test-requirements.txt), imported on
use.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmgw_testkit.checks import StreamedChat, stream_chat_with_usage

if TYPE_CHECKING:
    import httpx
    import openai
    from openai.types.chat import ChatCompletion

    from llmgw_testkit.cluster import SystemView

__all__ = [
    "chat_through_the_router",
    "client",
    "cmdline",
    "direct_request_refused",
    "engine_secret",
    "environ",
    "every_flag_in_help",
    "placed_on_the_cpu_node",
    "routed_request_served",
    "streaming_chat_through_the_router",
]

# A loaded two-core machine runs the engine: its replies take seconds to minutes.
TIMEOUT = 300.0


def client(system: SystemView, timeout: float = TIMEOUT) -> openai.OpenAI:
    """An OpenAI client of the router (which needs no key here), without retries."""
    import openai

    return openai.OpenAI(
        base_url=f"{system.router_url}/v1", api_key="unused", max_retries=0, timeout=timeout
    )


def cmdline(pid: int) -> list[str]:
    """A process's argv, as /proc shows it."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def environ(pid: int) -> list[bytes]:
    """A process's environment, ``KEY=value`` entries as /proc shows them."""
    return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def placed_on_the_cpu_node(
    system: SystemView, model: str, node_id: str, *, timeout: float = 600.0
) -> dict[str, Any]:
    """The one replica of ``model`` runs on the real (not simulated) CPU node ``node_id``
    with no GPU, its endpoint is the shard's port on loopback, and the router lists the
    model. Returns the shard (``pid``, ``port``...) for the engine's command-line checks."""
    node = system.wait_node_state(node_id, "READY")
    assert node["gpus"] == []
    assert node["simulated"] is False
    (replica,) = system.wait_replicas(model, 1, timeout=timeout)
    (shard,) = replica["shards"]
    assert shard["node_id"] == node_id
    assert shard["gpu_indices"] == []
    # The control plane publishes the engine's address; the router lists the model.
    assert replica["endpoint"] == f"http://127.0.0.1:{shard['port']}"
    assert model in system.router_models()
    result: dict[str, Any] = shard
    return result


def every_flag_in_help(flags: set[str], known: set[str], *, at_least: int) -> None:
    """Every flag the adapter emitted is one the engine's ``--help`` lists; ``known`` (the
    help's flags, parsed by the suite: each engine lays its help out its own way) has more
    than ``at_least`` flags, so the parse found the options table."""
    assert len(known) > at_least, f"the help parse found {len(known)} flags"
    assert flags <= known, sorted(flags - known)


def engine_secret(pid: int, variable: str) -> str:
    """The secret the agent gave the engine in its environment (``variable``), out of the
    command line ``ps`` shows, and long enough."""
    (secret,) = [
        e.split(b"=", 1)[1].decode() for e in environ(pid) if e.startswith(variable.encode() + b"=")
    ]
    assert secret not in " ".join(cmdline(pid))
    assert len(secret) >= 32
    return secret


def direct_request_refused(system: SystemView, model: str) -> httpx.Response:
    """Issue 24.3: a client going around the router (straight to the engine's endpoint) with
    no key, or with a wrong one, is refused 401. Returns the keyless answer (its body is the
    engine's own wording)."""
    import httpx

    (replica,) = system.replicas(model)
    url = f"{replica['endpoint']}/v1/chat/completions"
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    direct = httpx.post(url, json=body, timeout=60)
    assert direct.status_code == 401, direct.text
    wrong = httpx.post(url, json=body, headers={"Authorization": "Bearer unused"}, timeout=60)
    assert wrong.status_code == 401, wrong.text
    return direct


def routed_request_served(system: SystemView, model: str) -> None:
    """The same request through the router (which sends the engine's secret) is served."""
    reply = client(system).chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        extra_body={"ignore_eos": True},
    )
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 2


def chat_through_the_router(system: SystemView, model: str) -> ChatCompletion:
    """A greedy chat completion of 8 tokens: one assistant choice ended by length, and usage
    that adds up."""
    reply = client(system).chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "The capital of France is"}],
        max_tokens=8,
        temperature=0,
        # A base model may end at once; without its end token it writes exactly max_tokens.
        extra_body={"ignore_eos": True},
    )
    assert reply.object == "chat.completion"
    assert reply.model  # the engine names the model it serves
    (choice,) = reply.choices
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    usage = reply.usage
    assert usage is not None
    assert usage.prompt_tokens > 0
    assert usage.completion_tokens == 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    return reply


def streaming_chat_through_the_router(system: SystemView, model: str) -> StreamedChat:
    """A greedy streamed chat of 16 tokens with usage: chunks only, the usage last
    (:func:`llmgw_testkit.checks.stream_chat_with_usage`), the tokens one chunk at a time,
    ended by length."""
    got = stream_chat_with_usage(
        system.router_url,
        model,
        max_tokens=16,
        content="Once upon a time",
        api_key="unused",
        timeout=TIMEOUT,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    # All chunks are chat.completion.chunk, the last carries the usage, 16 tokens: checked there.
    pieces = got.pieces
    # Tokens arrive one chunk at a time, not as one block at the end.
    assert len(pieces) >= 2
    finishes = [c.choices[0].finish_reason for c in got.chunks if c.choices]
    assert finishes[-1] == "length"
    usage = got.usage
    assert usage.prompt_tokens > 0
    assert usage.completion_tokens == 16
    assert len(pieces) <= usage.completion_tokens
    return got
