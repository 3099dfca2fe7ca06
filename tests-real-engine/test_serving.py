"""A CPU-only profile placed, launched through the llama.cpp adapter, served by the router.

The model is a base model without a chat template: the tests check shapes, usage and
token counts, never the text.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai
from llmgw_testkit.checks import stream_chat_with_usage
from llmgw_testkit.cluster import Cluster

SERVED_NAME = "gemma3"


def _client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{cluster.router_url}/v1", api_key="unused", max_retries=0, timeout=120
    )


def test_placed_on_the_cpu_node_without_gpus(serving: Cluster, gguf: Path) -> None:
    node = serving.wait_node_state("cpu-a", "READY")
    assert node["gpus"] == []
    assert node["simulated"] is False
    (replica,) = serving.replicas(SERVED_NAME)
    (shard,) = replica["shards"]
    assert shard["node_id"] == "cpu-a"
    assert shard["gpu_indices"] == []
    cmdline = Path(f"/proc/{shard['pid']}/cmdline").read_bytes().decode().split("\0")
    assert Path(cmdline[0]).name == "llama-server"
    # The adapter built the command line from the profile.
    assert cmdline[cmdline.index("-m") + 1] == str(gguf)
    assert cmdline[cmdline.index("--port") + 1] == str(shard["port"])
    assert cmdline[cmdline.index("--alias") + 1] == SERVED_NAME
    assert cmdline[cmdline.index("--threads") + 1] == "2"
    assert cmdline[cmdline.index("-c") + 1] == "2048"
    assert "--n-gpu-layers" not in cmdline
    environ = Path(f"/proc/{shard['pid']}/environ").read_bytes().split(b"\0")
    assert b"CUDA_VISIBLE_DEVICES=" in environ


def test_chat_completion_through_the_router(serving: Cluster) -> None:
    reply = _client(serving).chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "The capital of France is"}],
        max_tokens=8,
        temperature=0,
        # A base model may end at once; without its end token it writes exactly max_tokens.
        extra_body={"ignore_eos": True},
    )
    assert reply.object == "chat.completion"
    assert reply.model  # llama.cpp names the model it loaded
    (choice,) = reply.choices
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    usage = reply.usage
    assert usage is not None
    assert usage.prompt_tokens > 0
    assert usage.completion_tokens == 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_streaming_chat_completion_through_the_router(serving: Cluster) -> None:
    got = stream_chat_with_usage(
        serving.router_url,
        SERVED_NAME,
        max_tokens=16,
        content="Once upon a time",
        api_key="unused",
        timeout=120,
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


def test_every_flag_the_adapter_emitted_is_in_the_real_help(
    serving: Cluster, llama_help: str
) -> None:
    (replica,) = serving.replicas(SERVED_NAME)
    (shard,) = replica["shards"]
    cmdline = Path(f"/proc/{shard['pid']}/cmdline").read_bytes().decode().split("\0")
    flags = [arg for arg in cmdline[1:] if arg.startswith("-")]
    assert {"-m", "--host", "--port", "--alias", "--threads", "--metrics", "-c"} <= set(flags)
    known = help_flags(llama_help)
    assert len(known) > 100  # the parse found the options table
    assert set(flags) <= known, sorted(set(flags) - known)


def help_flags(text: str) -> set[str]:
    """Flags in llama.cpp's --help: the left column, "-c,    --ctx-size N   size of ..."."""
    flags: set[str] = set()
    for line in text.splitlines():
        if not line.startswith("-"):
            continue
        # The description starts at column 40; a longer spec has it on the next line.
        spec = line[:40] if len(line) > 40 and line[39] == " " else line
        flags.update(re.findall(r"(?:^|[\s,])(--?[A-Za-z][\w.-]*)", spec))
    return flags


def test_the_engine_refuses_a_direct_request_and_serves_the_routed_one(
    serving: Cluster,
) -> None:
    """Issue 24.3: the real llama-server requires the secret the agent gave it (in
    LLAMA_API_KEY, out of its command line); the router sends it, a direct client has
    none."""
    (replica,) = serving.replicas(SERVED_NAME)
    (shard,) = replica["shards"]
    environ = Path(f"/proc/{shard['pid']}/environ").read_bytes().split(b"\0")
    (secret,) = [e.split(b"=", 1)[1] for e in environ if e.startswith(b"LLAMA_API_KEY=")]
    assert len(secret) >= 32
    assert secret not in Path(f"/proc/{shard['pid']}/cmdline").read_bytes()
    body = {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 2,
    }
    direct = httpx.post(f"{replica['endpoint']}/v1/chat/completions", json=body, timeout=60)
    assert direct.status_code == 401, direct.text
    assert direct.json()["error"]["message"] == "Invalid API Key"
    # llama-server guards /metrics as well; /health stays open.
    assert httpx.get(f"{replica['endpoint']}/metrics", timeout=30).status_code == 401
    assert httpx.get(f"{replica['endpoint']}/health", timeout=30).status_code == 200
    reply = _client(serving).chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=2,
        extra_body={"ignore_eos": True},
    )
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 2
