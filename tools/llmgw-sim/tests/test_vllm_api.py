"""The vLLM stand-in's HTTP API, checked with httpx and the official openai client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from llmgw_sim.testing import Sim, start
from llmgw_testkit.checks import stream_chat_with_usage

KEY = "sekrit"


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    args = [
        "--served-model-name", "m", "m-alias", "--max-model-len", "512", "--api-key", KEY,
        "--sim-embedding-dim", "8", "--enable-request-id-headers",
    ]  # fmt: skip
    with start(tmp_path_factory.mktemp("vllm"), "vllm", args) as sim:
        yield sim


@pytest.fixture
def oai(vllm: Sim) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=vllm.url + "/v1", api_key=KEY, max_retries=0) as c:
        yield c


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def test_models_lists_every_served_name(vllm: Sim, oai: openai.OpenAI) -> None:
    ids = [m.id for m in oai.models.list()]
    assert ids == ["m", "m-alias"]


def test_version_and_health(vllm: Sim, client: httpx.Client) -> None:
    assert client.get(vllm.url + "/health").status_code == 200
    assert client.get(vllm.url + "/version").json() == {"version": "0.32.0"}


def test_chat_non_streaming_carries_usage(vllm: Sim, client: httpx.Client) -> None:
    r = client.post(
        vllm.url + "/v1/chat/completions",
        headers=auth(),
        json={
            "model": "m",
            "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 7,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 7
    assert usage["total_tokens"] == usage["prompt_tokens"] + 7
    assert usage["prompt_tokens"] > 0


def test_openai_chat_stream_with_usage(vllm: Sim) -> None:
    got = stream_chat_with_usage(
        vllm.url, "m-alias", max_tokens=12, content="Count to ten", api_key=KEY
    )
    chunks = got.chunks
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len(got.pieces) == 12
    assert got.finishes == ["length"]
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == 12
    assert last.model == "m-alias"
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_sse_ends_with_done(vllm: Sim, client: httpx.Client) -> None:
    body = {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "stream": True,
    }  # fmt: skip
    with client.stream("POST", vllm.url + "/v1/chat/completions", headers=auth(), json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    # role chunk + 3 content chunks (the last carries finish_reason), no usage chunk.
    assert len(events) == 5
    assert '"usage"' not in "".join(events)


def test_openai_completions_stream_and_full(oai: openai.OpenAI) -> None:
    full = oai.completions.create(model="m", prompt="Once upon a time", max_tokens=5)
    assert full.usage is not None
    assert full.usage.completion_tokens == 5
    assert full.choices[0].finish_reason == "length"
    assert full.choices[0].text
    chunks = list(
        oai.completions.create(
            model="m",
            prompt="Once upon a time",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) == 4
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4


def test_completions_default_to_16_tokens(oai: openai.OpenAI) -> None:
    full = oai.completions.create(model="m", prompt="tell me")
    assert full.usage is not None
    assert full.usage.completion_tokens == 16


def test_openai_embeddings(oai: openai.OpenAI) -> None:
    res = oai.embeddings.create(model="m", input=["a cat", "a dog", "a cat"])
    vectors = [d.embedding for d in res.data]
    assert [len(v) for v in vectors] == [8, 8, 8]
    assert vectors[0] == vectors[2] != vectors[1]
    assert res.usage.prompt_tokens == 6


def test_unknown_model_is_404(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert "The model `nope` does not exist." in str(exc.value)


def test_bad_request_is_400_and_names_the_field(vllm: Sim, client: httpx.Client) -> None:
    r = client.post(vllm.url + "/v1/chat/completions", headers=auth(), json={"model": "m"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "BadRequestError"
    assert err["code"] == 400
    assert "messages" in err["message"]
    r = client.post(
        vllm.url + "/v1/chat/completions",
        headers=auth(),
        content=b"{not json",
    )
    assert r.status_code == 400
    assert "not valid JSON" in r.json()["error"]["message"]


def test_exceeding_max_model_len_is_400(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=600
        )
    assert "maximum context length is 512 tokens" in str(exc.value)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model="m", prompt="word " * 600, max_tokens=1)


def test_missing_or_wrong_api_key_is_401(vllm: Sim) -> None:
    for key in ("wrong", ""):
        with (
            openai.OpenAI(base_url=vllm.url + "/v1", api_key=key or "x", max_retries=0) as c,
            pytest.raises(openai.AuthenticationError),
        ):
            c.models.list()
    r = httpx.get(vllm.url + "/v1/models")
    assert r.status_code == 401
    assert r.json() == {"error": "Unauthorized"}


def test_injected_error_status_via_header(vllm: Sim, client: httpx.Client) -> None:
    r = client.post(
        vllm.url + "/v1/chat/completions",
        headers={**auth(), "X-Sim-Error": "503", "X-Sim-Error-Message": "overloaded"},
        json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 503
    assert r.json()["error"]["message"] == "overloaded"


def test_metrics_count_tokens_under_vllm_names(vllm: Sim, client: httpx.Client) -> None:
    before_gen = vllm.metric("vllm:generation_tokens_total")
    before_prompt = vllm.metric("vllm:prompt_tokens_total")
    before_ttft = vllm.metric("vllm:time_to_first_token_seconds_count")
    r = client.post(
        vllm.url + "/v1/completions",
        headers=auth(),
        json={"model": "m", "prompt": "one two three", "max_tokens": 9},
    )
    assert r.status_code == 200
    usage = r.json()["usage"]
    assert vllm.metric("vllm:generation_tokens_total") == before_gen + 9
    assert vllm.metric("vllm:prompt_tokens_total") == before_prompt + usage["prompt_tokens"]
    assert vllm.metric("vllm:time_to_first_token_seconds_count") == before_ttft + 1
    text = client.get(vllm.url + "/metrics").text
    for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket", "vllm:request_prefill_time_seconds_bucket",
        "vllm:request_decode_time_seconds_bucket", "vllm:request_inference_time_seconds_bucket",
        "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
        "vllm:request_params_max_tokens_bucket", "vllm:time_per_output_token_seconds_bucket",
    ):  # fmt: skip
        assert f'{name}{{engine="0",model_name="m"' in text, name
    assert 'vllm:cache_config_info{block_size="16"' in text
    # 1-2-5 token buckets stop at --max-model-len (512).
    assert 'vllm:request_prompt_tokens_bucket{engine="0",model_name="m",le="500.0"}' in text
    assert 'le="1000.0"' not in text


def test_prefix_cache_hits_on_repeated_prompt(vllm: Sim, client: httpx.Client) -> None:
    prompt = " ".join(f"word{i}" for i in range(100))
    before = vllm.metric("vllm:prefix_cache_hits_total")
    for _ in range(2):
        r = client.post(
            vllm.url + "/v1/completions",
            headers=auth(),
            json={"model": "m", "prompt": prompt, "max_tokens": 1},
        )
        assert r.status_code == 200
    # 100 tokens in blocks of 16: the second request finds 6 full blocks.
    assert vllm.metric("vllm:prefix_cache_hits_total") == before + 96
    assert vllm.metric("vllm:prefix_cache_hits_total") <= vllm.metric(
        "vllm:prefix_cache_queries_total"
    )


def test_tokenize_detokenize_round_trip(vllm: Sim, client: httpx.Client) -> None:
    r = client.post(vllm.url + "/tokenize", json={"model": "m", "prompt": "Hello, world!"})
    assert r.status_code == 200
    body = r.json()
    assert body["count"] == len(body["tokens"]) == 4
    assert body["max_model_len"] == 512
    r = client.post(vllm.url + "/detokenize", json={"model": "m", "tokens": body["tokens"]})
    assert r.json() == {"prompt": "Hello, world!"}
    r = client.post(vllm.url + "/detokenize", json={"tokens": "abc"})
    assert r.status_code == 400


def test_ignore_eos_runs_to_the_context_limit(vllm: Sim, client: httpx.Client) -> None:
    r = client.post(
        vllm.url + "/v1/chat/completions",
        headers=auth(),
        json={"model": "m", "messages": [{"role": "user", "content": "go"}], "ignore_eos": True},
    )
    usage = r.json()["usage"]
    assert usage["total_tokens"] == 512
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_named_failure_type_and_request_id_header(vllm: Sim, client: httpx.Client) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    r = client.post(
        vllm.url + "/v1/chat/completions",
        headers={**auth(), "X-Sim-Error": "rate_limit"},
        json=body,
    )
    assert r.status_code == 429
    r = client.post(
        vllm.url + "/v1/chat/completions", headers={**auth(), "X-Sim-Error": "teapot"}, json=body
    )
    assert r.status_code == 400
    assert "rate_limit" in r.json()["error"]["message"]
    r = client.post(
        vllm.url + "/v1/chat/completions", headers={**auth(), "X-Request-Id": "req-42"}, json=body
    )
    assert r.headers["X-Request-Id"] == "req-42"


def test_lora_modules_are_served_and_loadable(tmp_path: Path) -> None:
    args = ["--enable-lora", "--lora-modules", "sql=/loras/sql", '{"name": "chat", "path": "/l/c"}']
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "CUDA_VISIBLE_DEVICES": "0"}
    with start(tmp_path, "vllm", args, env=env) as sim, httpx.Client(timeout=10) as c:
        models = {m["id"]: m for m in c.get(sim.url + "/v1/models").json()["data"]}
        assert models["sql"]["parent"] == "org/model"
        assert models["chat"]["root"] == "/l/c"
        body = {"model": "sql", "messages": [{"role": "user", "content": "x"}]}
        assert c.post(sim.url + "/v1/chat/completions", json=body).status_code == 200
        r = c.post(sim.url + "/v1/load_lora_adapter", json={"lora_name": "new", "lora_path": "/p"})
        assert r.status_code == 200
        assert "added successfully" in r.text
        assert c.post(sim.url + "/v1/chat/completions", json={**body, "model": "new"}).is_success
        r = c.post(sim.url + "/v1/unload_lora_adapter", json={"lora_name": "new"})
        assert r.status_code == 200
        r = c.post(sim.url + "/v1/chat/completions", json={**body, "model": "new"})
        assert r.status_code == 404
        metrics = c.get(sim.url + "/metrics").text
        assert 'vllm:lora_requests_info{max_lora="1",running_lora_adapters=""' in metrics
