"""A real llama-server's stream gathered into a non-streamed answer (issue 28 point 1,
llmgw_router.proxy.gather): what the router answers a non-streamed request it asked of
the engine as a stream has the same fields and values as the engine's own non-streamed
answer (greedy), but for its id, created time and the engine's timings and cache figures
(the second request of a pair hits the prompt cache)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from llmgw_router.proxy.gather import Answer, streamed_request
from llmgw_router.proxy.resume import split_events
from llmgw_testkit import Proc, free_port, http_get, wait_for

# Differ between any two requests: the answer's identity and the engine's own timings.
_APART = ("id", "created", "timings")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Tell me about the sea."}]},
        ),
        ("/v1/completions", {"prompt": "Once upon a time"}),
    ],
)
def test_gathered_stream_is_llama_servers_own_answer(
    llama_server: Path, gguf: Path, tmp_path: Path, path: str, body: dict[str, Any]
) -> None:
    port = free_port()
    argv = [str(llama_server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    with Proc([*argv, "-t", "2", "-c", "1024"], log_dir=tmp_path, name="llama-server") as proc:
        url = f"http://127.0.0.1:{port}"
        wait_for(
            lambda: proc.alive() and http_get(url + "/health")[0] == 200,
            timeout=120,
            what="llama-server /health",
        )
        request = {"model": "m", "max_tokens": 24, "temperature": 0, **body}
        plain = httpx.post(url + path, json=request, timeout=120)
        assert plain.status_code == 200, plain.text
        streamed = streamed_request(path, json.dumps(request).encode())
        assert streamed is not None
        events = httpx.post(
            url + path,
            content=streamed,
            headers={"content-type": "application/json"},
            timeout=120,
        )
        assert events.headers["content-type"].startswith("text/event-stream")
    answer = Answer(chat=path == "/v1/chat/completions")
    whole, _ = split_events(events.content)
    for event in whole:
        answer.feed(event)
    status, raw = answer.result()
    assert status == 200
    gathered, own = json.loads(raw), plain.json()
    assert set(gathered) == set(own)
    for key in set(own) - set(_APART):
        if key == "usage":
            gathered[key].pop("prompt_tokens_details", None)
            own[key].pop("prompt_tokens_details", None)
        assert gathered[key] == own[key], key
