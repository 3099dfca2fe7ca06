"""A CPU-only profile placed, launched through the llama.cpp adapter, served by the router.

The model is a base model without a chat template: the tests check shapes, usage and
token counts, never the text.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from llmgw_testkit import serving_checks as checks
from llmgw_testkit.cluster import Cluster

SERVED_NAME = "gemma3"


def test_placed_on_the_cpu_node_without_gpus(serving: Cluster, gguf: Path) -> None:
    shard = checks.placed_on_the_cpu_node(serving, SERVED_NAME, "cpu-a")
    cmdline = checks.cmdline(shard["pid"])
    assert Path(cmdline[0]).name == "llama-server"
    # The adapter built the command line from the profile.
    assert cmdline[cmdline.index("-m") + 1] == str(gguf)
    assert cmdline[cmdline.index("--port") + 1] == str(shard["port"])
    assert cmdline[cmdline.index("--alias") + 1] == SERVED_NAME
    assert cmdline[cmdline.index("--threads") + 1] == "2"
    assert cmdline[cmdline.index("-c") + 1] == "2048"
    assert "--n-gpu-layers" not in cmdline
    assert b"CUDA_VISIBLE_DEVICES=" in checks.environ(shard["pid"])


def test_chat_completion_through_the_router(serving: Cluster) -> None:
    checks.chat_through_the_router(serving, SERVED_NAME)  # llama.cpp names its model file


def test_streaming_chat_completion_through_the_router(serving: Cluster) -> None:
    checks.streaming_chat_through_the_router(serving, SERVED_NAME)


def test_every_flag_the_adapter_emitted_is_in_the_real_help(
    serving: Cluster, llama_help: str
) -> None:
    (replica,) = serving.replicas(SERVED_NAME)
    (shard,) = replica["shards"]
    cmdline = checks.cmdline(shard["pid"])
    flags = {arg for arg in cmdline[1:] if arg.startswith("-")}
    assert {"-m", "--host", "--port", "--alias", "--threads", "--metrics", "-c"} <= flags
    checks.every_flag_in_help(flags, help_flags(llama_help), at_least=100)


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
    checks.engine_secret(shard["pid"], "LLAMA_API_KEY")
    direct = checks.direct_request_refused(serving, SERVED_NAME)
    assert direct.json()["error"]["message"] == "Invalid API Key"
    # llama-server guards /metrics as well; /health stays open.
    assert httpx.get(f"{replica['endpoint']}/metrics", timeout=30).status_code == 401
    assert httpx.get(f"{replica['endpoint']}/health", timeout=30).status_code == 200
    checks.routed_request_served(serving, SERVED_NAME)
