"""Resuming a broken stream, the pure part (proxy/resume.py): what may be resumed, the
request that continues an answer, the decision, and the splice of a continuation into
the client's one stream."""

from __future__ import annotations

import itertools
import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_router.proxy.resume import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    Decision,
    Splice,
    continuation,
    decide,
    refusal,
    split_events,
)

# ------------------------------------------------------------ an engine's stream


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def chat_stream(
    rid: str,
    created: int,
    pieces: list[str],
    *,
    prompt: int,
    usage: bool,
    continuous: bool = False,
    finish: str = "stop",
) -> list[bytes]:
    """A vLLM-shaped chat stream: the role chunk, one chunk per piece, the usage chunk."""
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": "m"}

    def chunk(delta: dict[str, Any], done: int, reason: str | None = None) -> bytes:
        body: dict[str, Any] = {
            **head,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}],
        }
        if continuous:
            body["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": done,
                "total_tokens": prompt + done,
            }
        return _event(body)

    events = [chunk({"role": "assistant", "content": ""}, 0)]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        events.append(chunk({"content": piece}, i + 1, finish if last else None))
    if usage:
        n = len(pieces)
        events.append(
            _event(
                {
                    **head,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": prompt,
                        "completion_tokens": n,
                        "total_tokens": prompt + n,
                    },
                }
            )
        )
    events.append(b"data: [DONE]\n\n")
    return events


def completion_stream(rid: str, created: int, pieces: list[str]) -> list[bytes]:
    head = {"id": rid, "object": "text_completion", "created": created, "model": "m"}
    events = [
        _event(
            {
                **head,
                "choices": [
                    {
                        "index": 0,
                        "text": piece,
                        "finish_reason": "length" if i == len(pieces) - 1 else None,
                    }
                ],
            }
        )
        for i, piece in enumerate(pieces)
    ]
    return [*events, b"data: [DONE]\n\n"]


def client_view(events: list[bytes]) -> tuple[str, list[dict[str, Any]]]:
    """What an OpenAI client reads: the text and every chunk."""
    text, chunks = "", []
    for raw in b"".join(events).split(b"\n\n"):
        if raw.startswith(b"data: {"):
            chunk = json.loads(raw[6:])
            chunks.append(chunk)
            for choice in chunk["choices"]:
                delta = choice.get("delta")
                text += (delta.get("content") if delta else choice.get("text")) or ""
    return text, chunks


words = st.lists(
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1),
    min_size=2,
    max_size=30,
)


# ------------------------------------------------------------------- the splice


@settings(max_examples=150, deadline=None)
@given(
    pieces=words,
    cuts=st.lists(st.integers(1, 29), min_size=1, max_size=2),
    prompt=st.integers(1, 5000),
    usage=st.booleans(),
    continuous=st.booleans(),
)
def test_spliced_chat_is_one_stream_with_the_whole_text(
    pieces: list[str], cuts: list[int], prompt: int, usage: bool, continuous: bool
) -> None:
    """Broken after any chunk, any number of times, continued by an engine that gives
    the rest: the client reads the whole text once, under the first id and created
    time, with one role chunk, and the usage of the whole answer (its own prompt)."""
    splice = Splice()
    out: list[bytes] = []
    done = 0
    # The first attempt breaks after `cut` of its events (the role chunk is one).
    points = sorted({min(c, len(pieces) - 1) for c in cuts})
    for attempt, point in enumerate([*points, len(pieces)]):
        rest = pieces[done:]
        # An engine's continuation prompt: the client's prompt and the text so far.
        events = chat_stream(
            f"chatcmpl-{attempt}",
            1000 + attempt,
            rest,
            prompt=prompt + done,
            usage=usage,
            continuous=continuous,
        )
        # The events this attempt gets out before it breaks: its role chunk and pieces.
        upto = 1 + (point - done) if point < len(pieces) else len(events)
        for event in events[:upto]:
            if attempt == 0:
                splice.observe(event)
                out.append(event)
            else:
                out.append(splice.rewrite(event))
        if point < len(pieces):
            assert not splice.finished
            assert splice.text == "".join(pieces[:point])
            assert splice.tokens == point
            assert (
                decide(
                    max_resumes=len(points),
                    resumes=splice.resumes,
                    now=0.0,
                    deadline=1.0,
                    finished=splice.finished,
                    why_not=splice.why_not,
                )
                is Decision.RESUME
            )
            splice.resumed()
            done = point
    text, chunks = client_view(out)
    assert text == "".join(pieces)
    assert {c["id"] for c in chunks} == {"chatcmpl-0"}
    assert {c["created"] for c in chunks} == {1000}
    roles = [c for c in chunks for ch in c["choices"] if "role" in ch["delta"]]
    assert len(roles) == 1
    assert chunks[0] is roles[0]
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"]]
    assert [f for f in finishes if f is not None] == ["stop"]
    if usage or continuous:
        last = [c["usage"] for c in chunks if c.get("usage")][-1]
        assert last == {
            "prompt_tokens": prompt,
            "completion_tokens": len(pieces),
            "total_tokens": prompt + len(pieces),
        }
    assert splice.done_sent


@settings(max_examples=100, deadline=None)
@given(pieces=words, cut=st.integers(1, 29))
def test_spliced_completion_is_one_stream(pieces: list[str], cut: int) -> None:
    cut = min(cut, len(pieces) - 1)
    splice = Splice()
    out = []
    for event in completion_stream("cmpl-a", 7, pieces)[:cut]:
        splice.observe(event)
        out.append(event)
    splice.resumed()
    for event in completion_stream("cmpl-b", 9, pieces[cut:]):
        out.append(splice.rewrite(event))
    text, chunks = client_view(out)
    assert text == "".join(pieces)
    assert {(c["id"], c["created"]) for c in chunks} == {("cmpl-a", 7)}


@settings(max_examples=100, deadline=None)
@given(
    events=st.lists(st.binary(min_size=1, max_size=40).map(lambda b: b.replace(b"\n", b""))).map(
        lambda xs: [b"data: " + x + b"\n\n" for x in xs]
    ),
    cuts=st.lists(st.integers(0, 2000)),
)
def test_events_come_whole_however_the_bytes_are_cut(events: list[bytes], cuts: list[int]) -> None:
    data = b"".join(events)
    bounds = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    held, got = b"", []
    for a, b in itertools.pairwise(bounds):
        whole, held = split_events(held + data[a:b])
        got += whole
    assert held == b""
    assert got == events


def test_tool_calls_and_reasoning_make_a_stream_unresumable() -> None:
    for delta, why in (
        ({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": "{"}}]}, "tool_call"),
        ({"reasoning_content": "hmm"}, "reasoning"),
    ):
        splice = Splice()
        splice.observe(_event({"id": "x", "created": 1, "choices": [{"index": 0, "delta": delta}]}))
        assert splice.why_not == why
        assert (
            decide(max_resumes=2, resumes=0, now=0, deadline=9, finished=False, why_not=why)
            is Decision.UNRESUMABLE
        )


def test_an_answer_whose_end_was_seen_needs_no_resume() -> None:
    splice = Splice()
    for event in chat_stream("a", 1, ["x", "y"], prompt=3, usage=False)[:-1]:
        splice.observe(event)
    assert splice.finished
    assert not splice.done_sent
    assert (
        decide(max_resumes=0, resumes=0, now=5, deadline=1, finished=True, why_not="")
        is Decision.DONE
    )


@given(
    max_resumes=st.integers(0, 5),
    resumes=st.integers(0, 6),
    now=st.floats(0, 10),
    deadline=st.floats(0, 10),
    finished=st.booleans(),
    why_not=st.sampled_from(["", "tool_call", "n"]),
)
def test_decide_in_its_order(
    max_resumes: int, resumes: int, now: float, deadline: float, finished: bool, why_not: str
) -> None:
    got = decide(
        max_resumes=max_resumes,
        resumes=resumes,
        now=now,
        deadline=deadline,
        finished=finished,
        why_not=why_not,
    )
    if finished:
        assert got is Decision.DONE
    elif why_not:
        assert got is Decision.UNRESUMABLE
    elif resumes >= max_resumes:
        assert got is Decision.RESUMES_SPENT
    elif now >= deadline:
        assert got is Decision.DEADLINE
    else:
        assert got is Decision.RESUME


# ------------------------------------------------------------ the continuation

extra_params = st.dictionaries(
    st.sampled_from(
        ["temperature", "top_p", "seed", "stop", "user", "presence_penalty", "stream_options"]
    ),
    st.one_of(st.integers(0, 9), st.text(max_size=5), st.just({"include_usage": True})),
)


@given(
    extra=extra_params,
    text=st.text(min_size=1),
    tokens=st.integers(1, 50),
    limit=st.sampled_from([None, "max_tokens", "max_completion_tokens"]),
)
def test_chat_continuation_keeps_every_parameter(
    extra: dict[str, Any], text: str, tokens: int, limit: str | None
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    body: dict[str, Any] = {"model": "m", "messages": messages, "stream": True, **extra}
    if limit:
        body[limit] = 60
    got = msgspec.json.decode(continuation(CHAT_PATH, msgspec.json.encode(body), text, tokens))
    assert got["messages"] == [*messages, {"role": "assistant", "content": text}]
    assert got["continue_final_message"] is True
    assert got["add_generation_prompt"] is False
    if limit:
        assert got[limit] == 60 - tokens
    for key, value in extra.items():
        assert got[key] == value
    assert got["model"] == "m"
    assert got["stream"] is True


def test_chat_continuation_of_a_prefill_extends_it() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "A:"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_tokens": 10,
        "min_tokens": 4,
    }
    got = msgspec.json.decode(continuation(CHAT_PATH, msgspec.json.encode(body), " b c", 3))
    assert got["messages"][-1] == {"role": "assistant", "content": "A: b c"}
    assert len(got["messages"]) == 2
    assert (got["max_tokens"], got["min_tokens"]) == (7, 1)


@pytest.mark.parametrize("prompt", ["Once", ["Once"]])
def test_completion_continuation_extends_the_prompt(prompt: Any) -> None:
    body = {"model": "m", "prompt": prompt, "stream": True}
    got = msgspec.json.decode(
        continuation(COMPLETIONS_PATH, msgspec.json.encode(body), " upon a", 2)
    )
    assert got["prompt"] == "Once upon a"
    # The completions API's default of 16 shrinks by what was produced.
    assert got["max_tokens"] == 14


def test_nothing_produced_resends_the_request_as_it_was() -> None:
    body = msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert msgspec.json.decode(continuation(CHAT_PATH, body, "", 0)) == msgspec.json.decode(body)


# ------------------------------------------------------------------- refusal


def _chat(**extra: Any) -> bytes:
    return msgspec.json.encode(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True, **extra}
    )


@pytest.mark.parametrize(
    ("path", "body", "why"),
    [
        (CHAT_PATH, _chat(), None),
        (CHAT_PATH, _chat(n=1, temperature=0.7, tools=[{"type": "function"}]), None),
        (COMPLETIONS_PATH, b'{"model":"m","prompt":"a","stream":true}', None),
        (COMPLETIONS_PATH, b'{"model":"m","prompt":["a"],"stream":true}', None),
        ("/v1/embeddings", b'{"model":"m","input":"a"}', "route"),
        (CHAT_PATH, _chat(stream=False), "not_streamed"),
        (CHAT_PATH, _chat(n=2), "n"),
        (COMPLETIONS_PATH, b'{"model":"m","prompt":"a","stream":true,"best_of":3}', "n"),
        (CHAT_PATH, _chat(logprobs=True), "logprobs"),
        (COMPLETIONS_PATH, b'{"model":"m","prompt":"a","stream":true,"logprobs":2}', "logprobs"),
        (COMPLETIONS_PATH, b'{"model":"m","prompt":"a","stream":true,"echo":true}', "echo"),
        (COMPLETIONS_PATH, b'{"model":"m","prompt":"a","stream":true,"suffix":"z"}', "suffix"),
        (CHAT_PATH, _chat(response_format={"type": "json_object"}), "structured_output"),
        (CHAT_PATH, _chat(guided_regex="a+"), "structured_output"),
        (COMPLETIONS_PATH, b'{"model":"m","prompt":[1,2],"stream":true}', "prompt_not_text"),
        (COMPLETIONS_PATH, b'{"model":"m","prompt":["a","b"],"stream":true}', "prompt_not_text"),
        (
            CHAT_PATH,
            _chat(
                messages=[{"role": "assistant", "content": [{"type": "text", "text": "a"}]}],
                continue_final_message=True,
            ),
            "content_parts",
        ),
        (CHAT_PATH, b'{"model":"m","stream":true,"n":"two"}', "body"),
        (
            CHAT_PATH,
            _chat(
                messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
            ),
            "final_assistant",
        ),
        (
            CHAT_PATH,
            _chat(
                messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                continue_final_message=True,
                add_generation_prompt=False,
            ),
            None,
        ),
    ],
)
def test_refusal(path: str, body: bytes, why: str | None) -> None:
    assert refusal(path, body) == why


@given(extra=extra_params)
def test_ordinary_streams_are_resumable(extra: dict[str, Any]) -> None:
    assert refusal(CHAT_PATH, _chat(**extra)) is None


@given(body=st.one_of(st.binary(max_size=200), extra_params.map(msgspec.json.encode)))
def test_any_body_gets_a_reason_not_a_traceback(body: bytes) -> None:
    for path in (CHAT_PATH, COMPLETIONS_PATH):
        why = refusal(path, body)
        assert why is None or isinstance(why, str)


@settings(max_examples=100, deadline=None)
@given(
    pieces=words,
    cut=st.integers(1, 29),
    groups=st.lists(st.integers(1, 4), min_size=1),
    usage=st.booleans(),
)
def test_events_fed_then_folded_are_followed_as_one_by_one(
    pieces: list[str], cut: int, groups: list[int], usage: bool
) -> None:
    """The relay feeds whole events in any grouping (and past FOLD_AT they are followed
    at once): what the splice knows after a fold is what following each one gives."""
    events = chat_stream("a", 3, pieces, prompt=9, usage=usage, continuous=usage)[: cut + 1]
    one_by_one = Splice()
    for event in events:
        one_by_one.observe(event)
    fed = Splice()
    at, i = 0, 0
    while at < len(events):
        size = groups[i % len(groups)]
        fed.feed(b"".join(events[at : at + size]))
        at, i = at + size, i + 1
    fed.fold()
    assert (fed.id, fed.created, fed.text, fed.tokens, fed.finished, fed.usage) == (
        one_by_one.id,
        one_by_one.created,
        one_by_one.text,
        one_by_one.tokens,
        one_by_one.finished,
        one_by_one.usage,
    )
    assert not fed.pending
