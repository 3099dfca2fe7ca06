"""The engines' other routes through real routers to simulated vLLM engines, with the
official clients: responses (stored, previous_response_id and GET/DELETE through another
router), Anthropic's messages (streamed; errors in Anthropic's shape), rerank, score,
tokenize, pooling, classify, audio (multipart)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import yaml
from llmgw_router.proxy.routes import decode_id
from llmgw_testkit import Proc, free_port, http_get, wait_for

BIN = Path(sys.executable).parent


@dataclass
class Router:
    url: str
    proc: Proc
    admin: str = ""


Fleet = tuple[list[Proc], list[Router]]


def _sim(tmp: Path, name: str) -> tuple[Proc, str]:
    port = free_port()
    argv = [str(BIN / "llmgw-sim"), "vllm", "serve", "m1", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--sim-load-time", "0", "--sim-name", name]
    return Proc(argv, log_dir=tmp, name=f"sim-{name}"), f"http://127.0.0.1:{port}"


def _router(tmp: Path, endpoints: list[dict[str, object]]) -> Router:
    port, admin = free_port(), free_port()
    path = tmp / f"router-{port}.yaml"
    config = {
        "listen": f"127.0.0.1:{port}",
        "admin_listen": f"127.0.0.1:{admin}",
        "workers": 1,
        "balancer": "round_robin",
        "endpoints": endpoints,
    }
    path.write_text(yaml.safe_dump(config))
    proc = Proc(
        [str(BIN / "llmgw-router"), "serve", "--config", str(path)], log_dir=tmp, name="router"
    )
    router = Router(f"http://127.0.0.1:{port}", proc, f"http://127.0.0.1:{admin}")
    try:
        wait_for(
            lambda: proc.alive() and http_get(f"http://127.0.0.1:{admin}/readyz")[0] == 200,
            timeout=60,
            what="router /readyz",
        )
    except BaseException:
        proc.stop()
        raise
    return router


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Two engines of `m1`, and two routers over the same two endpoints."""
    tmp = tmp_path_factory.mktemp("routes")
    sims: list[Proc] = []
    routers: list[Router] = []
    try:
        endpoints: list[dict[str, object]] = []
        for name in ("e1", "e2"):
            proc, url = _sim(tmp, name)
            sims.append(proc)
            endpoints.append({"id": name, "url": url, "models": ["m1"]})
        for ep in endpoints:
            wait_for(
                lambda ep=ep: http_get(f"{ep['url']}/health")[0] == 200,  # type: ignore[misc]
                timeout=60,
                what=f"engine {ep['id']}",
            )
        # A model whose only endpoint is gone: the router's 502/503 answers.
        endpoints.append({"id": "dead", "url": f"http://127.0.0.1:{free_port()}", "models": ["m9"]})
        routers.append(_router(tmp, endpoints))
        routers.append(_router(tmp, endpoints))
        yield sims, routers
    finally:
        for r in routers:
            r.proc.stop()
        for proc in sims:
            proc.stop()


def _openai(router: Router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=30)


def test_responses_stored_and_continued_through_any_router(fleet: Fleet) -> None:
    _, (r1, r2) = fleet
    first = _openai(r1).responses.with_raw_response.create(model="m1", input="Tell me a story")
    engine = first.headers["x-sim-name"]
    created = first.parse()
    assert created.output_text
    decoded = decode_id(created.id)
    assert decoded is not None
    assert decoded[1] == engine
    # Each follow-up, through either router, reaches the engine that stored it.
    for router in (r2, r1, r2):
        again = _openai(router).responses.with_raw_response.create(
            model="m1", input="And then?", previous_response_id=created.id
        )
        assert again.headers["x-sim-name"] == engine
        follow = again.parse()
        assert follow.previous_response_id == created.id
        got = _openai(router).responses.with_raw_response.retrieve(follow.id)
        assert got.headers["x-sim-name"] == engine
        assert got.parse().output_text == follow.output_text
    items = _openai(r2).responses.input_items.list(created.id)
    assert [item.type for item in items.data] == ["message"]
    # The query string reaches the engine: paging through either router.
    two = _openai(r1).responses.create(
        model="m1",
        input=[
            {"role": "user", "content": "first"},
            {"role": "user", "content": "second"},
        ],
    )
    for router in (r1, r2):
        page = _openai(router).responses.input_items.list(two.id, limit=1, order="desc")
        assert len(page.data) == 1
        assert page.has_more
        assert page.data[0].model_dump(warnings=False)["content"] == "second"
    _openai(r2).responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        _openai(r1).responses.retrieve(created.id)


def test_responses_streamed(fleet: Fleet) -> None:
    _, (r1, r2) = fleet
    client = _openai(r1)
    with client.responses.stream(model="m1", input="Stream it") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text
    assert decode_id(final.id) is not None
    # The usage of a streamed response (nested in its response.completed event) counts.
    assert final.usage is not None
    wanted = {"prompt": final.usage.input_tokens, "completion": final.usage.output_tokens}
    assert wanted["completion"] > 0
    # Counted as the relay ends, which may be just after the client has read the end.
    wait_for(
        lambda: all(_tokens(r1)[kind] >= n for kind, n in wanted.items()),
        timeout=10,
        what=f"llmgw_router_tokens_total at {wanted}",
    )
    assert _openai(r2).responses.retrieve(final.id).output_text == final.output_text


def _tokens(router: Router) -> dict[str, float]:
    """llmgw_router_tokens_total for m1, by kind, from the router's /metrics."""
    text = httpx.get(f"{router.admin}/metrics", timeout=10).text
    out = {"prompt": 0.0, "completion": 0.0}
    for line in text.splitlines():
        if line.startswith("llmgw_router_tokens_total{") and 'model="m1"' in line:
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            out[kind] = float(line.rsplit(" ", 1)[1])
    return out


def test_response_ids_not_of_the_fleet_are_404s(fleet: Fleet) -> None:
    _, (r1, _) = fleet
    with pytest.raises(openai.NotFoundError) as caught:
        _openai(r1).responses.retrieve("resp_notours")
    assert "resp_notours" in str(caught.value)
    gone = "resp_1-llmgw-mfrggzdfmztwq"  # names an endpoint the fleet does not have
    resp = httpx.get(f"{r1.url}/v1/responses/{gone}", timeout=10)
    assert resp.status_code == 404
    assert "no longer in the fleet" in resp.json()["error"]["message"]
    resp = httpx.put(f"{r1.url}/v1/responses/{gone}", timeout=10)
    assert resp.status_code == 405
    assert "GET or DELETE" in resp.json()["error"]["message"]


def _anthropic(router: Router) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=router.url, api_key="none", max_retries=0, timeout=30)


def test_messages_with_the_anthropic_client(fleet: Fleet) -> None:
    _, (r1, _) = fleet
    client = _anthropic(r1)
    # Read before either request: each is counted as its relay ends, which may be just after
    # the client has read its end, so a count read between them could miss the first.
    before = _tokens(r1)
    message = client.messages.create(
        model="m1", max_tokens=12, messages=[{"role": "user", "content": "Hello"}]
    )
    assert message.type == "message"
    assert message.content[0].type == "text"
    text = message.content[0].text
    with client.messages.stream(
        model="m1", max_tokens=12, messages=[{"role": "user", "content": "Hello"}]
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text
    assert final.usage.output_tokens == 12
    # Counted: the input tokens from the stream's first event, the output from its last.
    assert final.usage.input_tokens > 0
    wanted = {
        "prompt": before["prompt"] + message.usage.input_tokens + final.usage.input_tokens,
        "completion": before["completion"] + message.usage.output_tokens + 12,
    }
    wait_for(
        lambda: _tokens(r1) == wanted, timeout=10, what=f"llmgw_router_tokens_total at {wanted}"
    )


def test_messages_errors_in_anthropic_shape(fleet: Fleet) -> None:
    _, (r1, _) = fleet
    with pytest.raises(anthropic.NotFoundError) as caught:
        _anthropic(r1).messages.create(
            model="nope", max_tokens=5, messages=[{"role": "user", "content": "Hi"}]
        )
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["type"] == "error"
    assert body["error"]["type"] == "not_found_error"
    assert "nope" in body["error"]["message"]
    with pytest.raises(anthropic.APIStatusError) as failed:
        _anthropic(r1).messages.create(
            model="m9", max_tokens=5, messages=[{"role": "user", "content": "Hi"}]
        )
    assert failed.value.status_code in (502, 503)
    body = failed.value.body
    assert isinstance(body, dict)
    assert body["type"] == "error"
    assert body["error"]["type"] in ("api_error", "overloaded_error")
    resp = httpx.post(r1.url + "/v1/messages", content=b"{not json", timeout=10)
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank(fleet: Fleet, path: str) -> None:
    _, (r1, _) = fleet
    body = {"model": "m1", "query": "red fox", "documents": ["a red fox", "blue sky"]}
    resp = httpx.post(r1.url + path, json=body, timeout=10)
    assert resp.status_code == 200, resp.text
    assert [r["index"] for r in resp.json()["results"]] == [0, 1]


@pytest.mark.parametrize(
    ("path", "body", "key"),
    [
        ("/v1/score", {"text_1": "a", "text_2": ["a", "b"]}, "data"),
        ("/tokenize", {"prompt": "hello world"}, "tokens"),
        ("/pooling", {"input": ["x", "y"]}, "data"),
        ("/classify", {"input": "good"}, "data"),
    ],
)
def test_json_routes(fleet: Fleet, path: str, body: dict[str, object], key: str) -> None:
    _, (r1, _) = fleet
    resp = httpx.post(r1.url + path, json={"model": "m1", **body}, timeout=10)
    assert resp.status_code == 200, resp.text
    assert resp.json()[key]
    missing = httpx.post(r1.url + path, json=body, timeout=10)
    assert missing.status_code == 400
    assert "model" in missing.json()["error"]["message"]


def test_audio_with_the_openai_client(fleet: Fleet, tmp_path: Path) -> None:
    _, (r1, _) = fleet
    audio = tmp_path / "a.wav"
    audio.write_bytes(b"RIFF" + bytes(range(256)) * 40)
    client = _openai(r1)
    with audio.open("rb") as f:
        text = client.audio.transcriptions.create(model="m1", file=f).text
    with audio.open("rb") as f:
        again = client.audio.translations.create(model="m1", file=f).text
    assert text
    assert again == text


def test_audio_form_errors(fleet: Fleet) -> None:
    _, (r1, _) = fleet
    url = r1.url + "/v1/audio/transcriptions"
    no_model = httpx.post(url, files={"file": ("a.wav", b"xx")}, timeout=10)
    assert no_model.status_code == 400
    assert "no `model` field" in no_model.json()["error"]["message"]
    not_form = httpx.post(url, json={"model": "m1"}, timeout=10)
    assert not_form.status_code == 400
    assert "multipart/form-data" in not_form.json()["error"]["message"]
    unknown = httpx.post(url, data={"model": "zz"}, files={"file": ("a", b"x")}, timeout=10)
    assert unknown.status_code == 404
    assert json.loads(unknown.text)["error"]["code"] == "model_not_found"
