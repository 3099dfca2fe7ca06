"""Gathering a stream into a non-streamed answer (issue 28 point 1, proxy/gather.py):
which non-streamed requests are asked as streams, and the answer assembled from the
events, which for the deterministic simulator equals the engine's own non-streamed
answer (up to its id and created time and the fields it leaves null)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llmgw_router.proxy.gather import Answer, streamed_request
from llmgw_router.proxy.resume import split_events
from llmgw_sim.testing import Sim, start
from openai.types import Completion
from openai.types.chat import ChatCompletion

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _gather(path: str, stream: bytes, cuts: Sequence[int] = ()) -> tuple[int, dict[str, Any]]:
    """Feed ``stream`` in pieces cut at ``cuts``, as the relay hands it on."""
    answer = Answer(chat=path == CHAT)
    held = b""
    at = 0
    for cut in [*sorted(c % (len(stream) + 1) for c in cuts), len(stream)]:
        events, held = split_events(held + stream[at:cut])
        for event in events:
            answer.feed(event)
        at = max(at, cut)
    if held.strip():
        answer.feed(held)
    status, body = answer.result()
    return status, json.loads(body)


def _chunk(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _chat_stream(pieces: list[str], finish: str = "stop") -> bytes:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}
    out = [
        _chunk({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    ]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        choice = {"index": 0, "delta": {"content": piece}, "logprobs": None}
        choice["finish_reason"] = finish if last else None
        if last:
            choice["stop_reason"] = None
        out.append(_chunk({**head, "choices": [choice]}))
    usage = {"prompt_tokens": 5, "completion_tokens": len(pieces), "total_tokens": 5 + len(pieces)}
    out.append(_chunk({**head, "choices": [], "usage": usage}))
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


def test_a_chat_stream_becomes_one_answer() -> None:
    status, answer = _gather(CHAT, _chat_stream(["Hel", "lo", " there"]))
    assert status == 200
    assert answer == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 7,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello there"},
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
            }
        ],
        "system_fingerprint": None,
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }
    # What OpenAI's own client reads a chat completion as.
    parsed = ChatCompletion.model_validate(answer)
    assert parsed.choices[0].message.content == "Hello there"
    assert parsed.usage is not None
    assert parsed.usage.completion_tokens == 3


def test_a_completion_stream_keeps_the_fingerprint_and_reasoning_is_gathered() -> None:
    head = {"id": "cmpl-9", "object": "text_completion", "created": 3, "model": "m"}
    stream = b"".join(
        [
            _chunk({**head, "system_fingerprint": "b42", "choices": [{"index": 0, "text": "a"}]}),
            _chunk({**head, "choices": [{"index": 0, "text": "b", "finish_reason": "length"}]}),
        ]
    )
    status, answer = _gather(COMPLETIONS, stream)
    assert status == 200
    assert answer["choices"][0]["text"] == "ab"
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["system_fingerprint"] == "b42"
    assert answer["object"] == "text_completion"
    assert Completion.model_validate(answer).choices[0].text == "ab"
    reasoning = _chunk(
        {
            "id": "c",
            "created": 1,
            "choices": [{"index": 0, "delta": {"reasoning_content": "think"}}],
        }
    )
    _, chat = _gather(CHAT, reasoning + _chat_stream(["x"]))
    assert chat["choices"][0]["message"] == {
        "role": "assistant",
        "content": "x",
        "reasoning_content": "think",
    }


def test_an_error_event_becomes_an_openai_error_answer() -> None:
    stream = _chat_stream(["Hel", "lo"])[:-30]
    error = {"error": {"message": "gone", "type": "upstream_error", "param": None, "code": "x"}}
    status, answer = _gather(CHAT, stream.rsplit(b"data: ", 1)[0] + _chunk(error))
    assert status == 502
    assert answer == error
    status, answer = _gather(CHAT, b": just a comment\n\n")
    assert status == 502
    assert answer["error"]["type"] == "upstream_error"


@given(
    pieces=st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=20),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
)
def test_any_cutting_of_the_stream_gathers_the_same_answer(
    pieces: list[str], cuts: list[int]
) -> None:
    stream = _chat_stream(pieces)
    whole = _gather(CHAT, stream)
    assert _gather(CHAT, stream, cuts) == whole
    assert whole[1]["choices"][0]["message"]["content"] == "".join(pieces)


def test_which_requests_are_asked_as_streams() -> None:
    messages: list[dict[str, str]] = [{"role": "user", "content": "hi"}]
    body: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": 5}
    streamed = streamed_request(CHAT, json.dumps(body).encode())
    assert streamed is not None
    assert json.loads(streamed) == {
        **body,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    kept = [
        {**body, "stream": True},
        {**body, "n": 2},
        {**body, "logprobs": True},
        {**body, "tools": [{"type": "function", "function": {"name": "f"}}]},
        {**body, "stream_options": {"include_usage": True}},
        {**body, "response_format": {"type": "json_object"}},
        {**body, "messages": [*messages, {"role": "assistant", "content": "a"}]},
    ]
    for request in kept:
        assert streamed_request(CHAT, json.dumps(request).encode()) is None, request
    assert streamed_request("/v1/embeddings", json.dumps(body).encode()) is None
    assert streamed_request(CHAT, b"{not json") is None
    assert streamed_request(CHAT, b"[1, 2]") is None
    prompt = {"model": "m", "prompt": "Once", "stream": False}
    assert streamed_request(COMPLETIONS, json.dumps(prompt).encode()) is not None
    assert streamed_request(COMPLETIONS, json.dumps({**prompt, "prompt": [1, 2]}).encode()) is None


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@given(extra=st.dictionaries(st.text(max_size=12), _JSON, max_size=6))
def test_a_streamed_stand_in_changes_nothing_but_streaming(extra: dict[str, Any]) -> None:
    body = {**extra, "model": "m", "prompt": "Once upon"}
    streamed = streamed_request(COMPLETIONS, json.dumps(body).encode())
    if streamed is None:
        return
    out = json.loads(streamed)
    assert out.pop("stream") is True
    assert out.pop("stream_options") == {"include_usage": True}
    assert out == {k: v for k, v in body.items() if k not in ("stream", "stream_options")}


# The assembled answer against the deterministic simulator's own non-streamed answer.


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    with start(tmp_path_factory.mktemp("sim"), "vllm", ["--sim-load-time", "0"]) as engine:
        yield engine


def _same(gathered: dict[str, Any], engine: dict[str, Any], where: str = "") -> None:
    """Equal but for what the engine leaves null (or empty) and the answer's id/created."""
    for key in set(gathered) | set(engine):
        if where == "" and key in ("id", "created"):
            continue
        mine, theirs = gathered.get(key), engine.get(key)
        if isinstance(mine, dict) and isinstance(theirs, dict):
            _same(mine, theirs, f"{where}.{key}")
        elif isinstance(mine, list) and isinstance(theirs, list) and len(mine) == len(theirs):
            for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
                if isinstance(a, dict) and isinstance(b, dict):
                    _same(a, b, f"{where}.{key}[{i}]")
                else:
                    assert a == b, f"{where}.{key}[{i}]"
        elif key not in gathered:
            assert theirs in (None, [], {}), f"{where}.{key}: {theirs!r} not gathered"
        else:
            assert mine == theirs, f"{where}.{key}: {mine!r} != {theirs!r}"


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    chat=st.booleans(),
    prompt=st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), max_size=40),
    max_tokens=st.integers(min_value=1, max_value=30),
    seed=st.none() | st.integers(min_value=0, max_value=1000),
)
def test_gathering_the_simulators_stream_gives_its_own_answer(
    sim: Sim, chat: bool, prompt: str, max_tokens: int, seed: int | None
) -> None:
    path = CHAT if chat else COMPLETIONS
    body: dict[str, Any] = {"model": "org/model", "max_tokens": max_tokens}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if seed is not None:
        body["seed"] = seed
    plain = httpx.post(sim.url + path, json=body, timeout=30)
    assert plain.status_code == 200, plain.text
    streamed = streamed_request(path, json.dumps(body).encode())
    assert streamed is not None
    events = httpx.post(
        sim.url + path,
        content=streamed,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert events.headers["content-type"].startswith("text/event-stream")
    status, gathered = _gather(path, events.content)
    assert status == 200
    _same(gathered, plain.json())
