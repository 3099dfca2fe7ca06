"""No request body makes the simulator do unbounded work or stall /health (issue 13.4)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest
from llmgw_sim.testing import Sim, start

HUGE = 10000000000000000000  # fits msgspec's uint64, far beyond any embedding size


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    args = ["--served-model-name", "m", "--max-model-len", "512", "--sim-embedding-dim", "16"]
    with start(tmp_path_factory.mktemp("vllm"), "vllm", args) as sim:
        yield sim


def _embed(sim: Sim, dimensions: int) -> httpx.Response:
    # Raw JSON, so the number travels as written (no float rounding by a client).
    body = b'{"model":"m","input":"a cat","dimensions":%d}' % dimensions
    headers = {"Content-Type": "application/json"}
    return httpx.post(sim.url + "/v1/embeddings", content=body, headers=headers, timeout=30)


def test_huge_embedding_dimensions_refused_as_vllm_does(vllm: Sim) -> None:
    replies: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: replies.append(_embed(vllm, HUGE)))
    worker.start()
    try:
        # /health answers while (and after) the request is handled.
        assert httpx.get(vllm.url + "/health", timeout=10).status_code == 200
    finally:
        worker.join(timeout=40)
    assert replies, "the embeddings request never got an answer"
    r = replies[0]
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError"
    assert err["message"] == (f"Model 'm' only supports dimensions in range [1, 16], got {HUGE}.")


def test_dimensions_within_the_embedding_size_shorten_the_vector(vllm: Sim) -> None:
    r = _embed(vllm, 4)
    assert r.status_code == 200, r.text
    assert len(r.json()["data"][0]["embedding"]) == 4
    assert _embed(vllm, 17).status_code == 400


def test_huge_prompt_is_refused_after_bounded_tokenizing(vllm: Sim) -> None:
    prompt = "word " * 3_000_000  # 15 MB, 3 million tokens
    r = httpx.post(
        vllm.url + "/v1/completions",
        json={"model": "m", "prompt": prompt, "max_tokens": 1},
        timeout=60,
    )
    assert r.status_code == 400, r.text[:500]
    message = r.json()["error"]["message"]
    assert "maximum context length is 512 tokens" in message
    # Counting stopped at the cap instead of walking all 3 million tokens.
    assert "has at least 1048576 input tokens" in message
    assert httpx.get(vllm.url + "/health", timeout=10).status_code == 200
