"""relay.usage_from: the token counts of an answer, whichever API's shape, from the last
bytes of a stream or a whole JSON body."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st
from llmgw_router.proxy.relay import first_usage, usage_from


def _sse(*events: dict[str, object]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)


def test_chat_stream_usage_chunk() -> None:
    tail = _sse(
        {"choices": [{"delta": {"content": "hi"}}]},
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}},
    )
    usage = usage_from(tail + b"data: [DONE]\n\n", True)
    assert usage is not None
    assert usage.counts == (7, 3)


def test_responses_stream_nests_usage_in_the_completed_event() -> None:
    tail = _sse(
        {"type": "response.output_text.done", "text": "a story"},
        {
            "type": "response.completed",
            "response": {
                "id": "resp_1",
                "output": [{"content": [{"text": "{not a brace} " * 20}]}],
                "usage": {
                    "input_tokens": 12,
                    "input_tokens_details": {"cached_tokens": 0},
                    "output_tokens": 30,
                    "output_tokens_details": {"reasoning_tokens": 0},
                },
                "user": None,
            },
        },
    )
    usage = usage_from(tail, True)
    assert usage is not None
    assert usage.counts == (12, 30)


def _anthropic_stream(prompt: int, completion: int) -> bytes:
    return _sse(
        {
            "type": "message_start",
            "message": {"id": "msg_1", "usage": {"input_tokens": prompt, "output_tokens": 1}},
        },
        {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "hi"}},
        {"type": "message_delta", "usage": {"output_tokens": completion}},
        {"type": "message_stop"},
    )


@given(st.integers(1, 10**6), st.integers(1, 10**6))
def test_an_anthropic_stream_in_one_read_gives_both_counts(prompt: int, completion: int) -> None:
    # A short stream can come whole in the first read: its input tokens are in its first
    # usage (message_start), its output tokens in its last (message_delta). Reading the
    # first read's last usage for the input counted 0 (CI, test_more_routes).
    whole = _anthropic_stream(prompt, completion)
    last = usage_from(whole, True)
    early = first_usage(whole)
    assert last is not None
    assert early is not None
    assert last.counts == (0, completion)
    assert early.counts[0] == prompt


def test_usage_null_or_cut_off_is_none() -> None:
    assert usage_from(_sse({"type": "response.created", "response": {"usage": None}}), True) is None
    assert usage_from(b'data: {"usage": {"input_tokens": 1', True) is None


@given(
    st.integers(0, 10**6),
    st.integers(0, 10**6),
    st.integers(0, 5000),
    st.integers(0, 10**9),
)
def test_a_completed_event_longer_than_the_tail_still_counts(
    prompt: int, completion: int, text: int, cut: int
) -> None:
    # The tail kept is the last two reads: the event's start (and the output text before
    # the usage) may be gone.
    event = _sse(
        {
            "type": "response.completed",
            "response": {
                "output": [{"content": [{"text": "x" * text}]}],
                "usage": {"input_tokens": prompt, "output_tokens": completion},
            },
        }
    )
    at = event.index(b'"usage"')
    tail = event[cut % (at + 1) :]
    usage = usage_from(tail, True)
    assert usage is not None
    assert usage.counts == (prompt, completion)
