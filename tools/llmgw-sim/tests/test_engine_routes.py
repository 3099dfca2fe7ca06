"""routes_more.py: the Responses API (stored, continued, deleted), Anthropic's messages,
rerank and score, audio, /openapi.json, and which engine kind serves which."""

from __future__ import annotations

from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from llmgw_sim.routes_more import served_paths
from llmgw_sim.testing import start


def test_vllm_serves_the_responses_api_with_stored_responses(tmp_path: Path) -> None:
    with start(tmp_path, "vllm", ["--served-model-name", "m"]) as sim:
        client = openai.OpenAI(base_url=sim.url + "/v1", api_key="none", max_retries=0)
        first = client.responses.create(model="m", input="Once upon a time")
        assert first.output_text
        again = client.responses.create(model="m", input="Once upon a time")
        assert again.output_text == first.output_text  # deterministic
        follow = client.responses.create(model="m", input="Go on", previous_response_id=first.id)
        assert follow.previous_response_id == first.id
        assert client.responses.retrieve(follow.id).output_text == follow.output_text
        client.responses.delete(follow.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(follow.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="m", input="x", previous_response_id="resp_nope")
        paths = httpx.get(sim.url + "/openapi.json", timeout=10).json()["paths"]
        assert {"/v1/responses", "/v1/messages", "/v1/rerank", "/tokenize"} <= set(paths)
        assert "/v1/responses/{response_id}" in paths


def test_messages_rerank_and_audio(tmp_path: Path) -> None:
    with start(tmp_path, "vllm", ["--served-model-name", "m"]) as sim:
        message = anthropic.Anthropic(base_url=sim.url, api_key="none", max_retries=0)
        reply = message.messages.create(
            model="m", max_tokens=5, messages=[{"role": "user", "content": "Hi"}]
        )
        assert reply.usage.output_tokens == 5
        ranked = httpx.post(
            sim.url + "/v2/rerank",
            json={"model": "m", "query": "red fox", "documents": ["blue sky", "a red fox"]},
            timeout=10,
        ).json()["results"]
        assert ranked[0]["index"] == 1
        text = (
            openai.OpenAI(base_url=sim.url + "/v1", api_key="none", max_retries=0)
            .audio.transcriptions.create(model="m", file=("a.wav", b"RIFF0000"))
            .text
        )
        assert text
        echoed = httpx.post(
            sim.url + "/v1/score",
            json={"model": "m", "text_1": "a", "text_2": "a"},
            headers={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"},
            timeout=10,
        )
        assert echoed.headers["x-sim-traceparent"].startswith("00-111")


def test_each_kind_serves_its_own_routes(tmp_path: Path) -> None:
    assert "/v1/messages" not in served_paths("sglang")
    assert "/v1/responses" not in served_paths("llama-server")
    with start(tmp_path, "llama-server") as sim:
        ok = httpx.post(
            sim.url + "/v1/messages",
            json={"max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]},
            timeout=10,
        )
        assert ok.status_code == 200
        assert (
            httpx.post(sim.url + "/v1/responses", json={"input": "x"}, timeout=10).status_code
            == 404
        )
        assert httpx.get(sim.url + "/openapi.json", timeout=10).status_code == 404
