"""Issue 29 point 10, the pure parts: an engine's error in OpenAI's shape whatever the
engine said, and the request id the router passes through or makes."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from llmgw_router import request_id
from llmgw_router.engine_errors import openai_error, other_headers


def shape(body: bytes) -> dict[str, Any]:
    data = json.loads(body)
    assert list(data) == ["error"]
    error = data["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str)
    assert error["message"]
    assert isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)
    return dict(error)


def test_each_engine_s_error_becomes_openai_s_shape() -> None:
    sglang = (
        b'{"object":"error","message":"bad temp","type":"BadRequestError","param":null,"code":400}'
    )
    assert shape(openai_error(400, sglang)) == {
        "message": "bad temp",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    llamacpp = b'{"error":{"code":400,"message":"no prompt","type":"invalid_request_error"}}'
    assert shape(openai_error(400, llamacpp))["type"] == "invalid_request_error"
    fastapi = b'{"detail":"Not Found"}'
    assert shape(openai_error(404, fastapi))["message"] == "Not Found"
    text = b"upstream connect error"
    assert shape(openai_error(503, text)) == {
        "message": "upstream connect error",
        "type": "upstream_error",
        "param": None,
        "code": None,
    }
    assert "503" in shape(openai_error(503, b""))["message"]
    worded = b'{"error":{"message":"m","type":"rate_limit_error","param":"model","code":"busy"}}'
    assert shape(openai_error(429, worded)) == {
        "message": "m",
        "type": "rate_limit_error",
        "param": "model",
        "code": "busy",
    }


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
bodies = (
    st.binary(max_size=200)
    | json_values.map(lambda v: json.dumps(v).encode())
    | st.dictionaries(
        st.sampled_from(["error", "message", "detail", "type", "code", "param", "object"]),
        json_values,
        max_size=5,
    ).map(lambda v: json.dumps(v).encode())
)


@given(st.integers(400, 599), bodies)
def test_any_engine_answer_becomes_openai_s_shape(status: int, payload: bytes) -> None:
    error = shape(openai_error(status, payload))
    if status >= 500 and error["type"] not in ("upstream_error",):
        # Only a snake_case type the engine gave is kept.
        assert error["type"].replace("_", "").isalnum()
        assert error["type"].islower()


def test_error_headers_lose_only_what_the_new_body_changes() -> None:
    headers = [
        (b"content-type", b"text/plain"),
        (b"content-length", b"9"),
        (b"retry-after", b"3"),
        (b"x-sim-name", b"e1"),
    ]
    assert other_headers(headers) == [(b"retry-after", b"3"), (b"x-sim-name", b"e1")]


def test_request_id_passes_through_or_is_made() -> None:
    given_id = {request_id.HEADER: b"req-123"}
    assert request_id.ensure(given_id) == b"req-123"
    empty: dict[bytes, bytes] = {}
    made = request_id.ensure(empty)
    assert empty[request_id.HEADER] == made
    assert len(made) == 32
    assert request_id.with_id([(b"x-request-id", b"engine's"), (b"a", b"b")], made) == [
        (b"a", b"b"),
        (b"x-request-id", made),
    ]


@given(st.binary(max_size=200))
def test_request_id_is_always_a_safe_token(value: bytes) -> None:
    headers = {request_id.HEADER: value}
    rid = request_id.ensure(headers)
    assert request_id.acceptable(rid)
    assert headers[request_id.HEADER] == rid
    # Passed through exactly when it is a plain token; a header line cannot be split.
    assert (rid == value) == request_id.acceptable(value)
    assert not set(rid) & set(b"\r\n ")
