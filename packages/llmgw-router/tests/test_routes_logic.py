"""routes.py's pure parts: response ids that name their replica, their rewriting in a
body or a stream however it is split, multipart form fields, Anthropic's error shape."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from llmgw_router.errors import ApiError
from llmgw_router.proxy import routes

engine_ids = st.from_regex(r"resp_[A-Za-z0-9_\-]{1,40}", fullmatch=True)
endpoint_ids = st.text(min_size=1, max_size=60).filter(lambda s: "\x00" not in s)


@given(engine_ids, endpoint_ids)
def test_ids_round_trip(engine_id: str, endpoint_id: str) -> None:
    encoded = routes.encode_id(engine_id, endpoint_id)
    assert encoded.startswith("resp_")
    # Safe in a URL path and in JSON without escapes.
    assert all(c.isalnum() or c in "_-" for c in encoded)
    assert routes.decode_id(encoded) == (engine_id, endpoint_id)


@given(st.text(max_size=80))
def test_decode_never_raises(value: str) -> None:
    decoded = routes.decode_id(value)
    assert decoded is None or all(decoded)


def test_decode_refuses_plain_ids() -> None:
    assert routes.decode_id("resp_abc123") is None
    assert routes.decode_id("resp_abc-llmgw-") is None
    assert routes.decode_id("resp_abc-llmgw-!!") is None


def _stream(ids: list[str]) -> bytes:
    events = []
    for i, rid in enumerate(ids):
        data = {"type": "response.created", "sequence_number": i, "response": {"id": rid}}
        events.append(b"event: x\ndata: " + msgspec.json.encode(data) + b"\n\n")
    return b"".join(events)


@given(st.lists(engine_ids, min_size=1, max_size=5), st.data())
def test_stream_rewrite_is_split_proof(ids: list[str], data: st.DataObject) -> None:
    whole = _stream(ids)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(whole)), max_size=8)))
    pieces = [whole[a:b] for a, b in zip([0, *cuts], [*cuts, len(whole)], strict=True)]
    rewriter = routes.IdRewriter("ep-1")
    out = b"".join(rewriter.feed(p) for p in pieces) + rewriter.flush()
    assert out == routes.IdRewriter("ep-1").whole(whole)
    events = [json.loads(line[6:]) for line in out.split(b"\n") if line.startswith(b"data: ")]
    assert [routes.decode_id(e["response"]["id"]) for e in events] == [(rid, "ep-1") for rid in ids]


def test_rewrite_touches_only_response_id_fields() -> None:
    body = (
        b'{"id":"resp_1","previous_response_id":"resp_0","output":[{"id":"msg_1",'
        b'"text":"\\"resp_9\\" and \\"id\\":\\"resp_8\\""}],"other":"resp_7"}'
    )
    out = json.loads(routes.IdRewriter("e").whole(body))
    assert routes.decode_id(out["id"]) == ("resp_1", "e")
    assert routes.decode_id(out["previous_response_id"]) == ("resp_0", "e")
    assert out["output"][0] == {"id": "msg_1", "text": '"resp_9" and "id":"resp_8"'}
    assert out["other"] == "resp_7"
    # Already encoded ids stay as they are.
    assert routes.IdRewriter("f").whole(json.dumps(out).encode()) == json.dumps(out).encode()


def test_previous_response_pins_and_restores_the_engine_id() -> None:
    encoded = routes.encode_id("resp_abc", "ep 7")
    body = json.dumps({"model": "m", "input": "x", "previous_response_id": encoded}).encode()
    found = routes.previous_response(body)
    assert found is not None
    endpoint_id, engine_id, new_body = found
    assert (endpoint_id, engine_id) == ("ep 7", "resp_abc")
    assert json.loads(new_body)["previous_response_id"] == "resp_abc"
    assert routes.previous_response(b'{"model":"m","previous_response_id":"resp_x"}') is None
    assert routes.previous_response(b'{"model":"m"}') is None


def _form(fields: dict[str, bytes], boundary: str = "XyZ") -> bytes:
    parts = []
    for name, value in fields.items():
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"'
        if name == "file":
            head += '; filename="a.wav"\r\nContent-Type: audio/wav'
        parts.append(head.encode() + b"\r\n\r\n" + value + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode()


form_values = st.binary(max_size=200).filter(lambda b: b"--XyZ" not in b and b"\r\n--" not in b)


@given(form_values, st.text(min_size=1, max_size=30).filter(lambda s: "\r" not in s))
def test_form_field_finds_the_model_after_any_file(audio: bytes, model: str) -> None:
    body = _form({"file": audio, "model": model.encode()})
    ctype = b"multipart/form-data; boundary=XyZ"
    assert routes.form_field(body, ctype, "model") == model
    assert routes.form_field(body, b'multipart/form-data; boundary="XyZ"', "model") == model
    assert routes.form_field(body, ctype, "language") is None


@given(st.binary(max_size=300), st.binary(max_size=80))
def test_form_field_never_raises_anything_but_a_400(body: bytes, ctype: bytes) -> None:
    status = 0
    try:
        routes.form_field(body, ctype, "model")
    except ApiError as err:
        status = err.status
    assert status in (0, 400)


@pytest.mark.parametrize(
    ("body", "ctype", "words"),
    [
        (b"{}", b"application/json", "multipart/form-data"),
        (b"", b"multipart/form-data", "no boundary"),
        (b"nothing", b"multipart/form-data; boundary=XyZ", "does not contain its boundary"),
        (b"--XyZ\r\nname", b"multipart/form-data; boundary=XyZ", "no end to its headers"),
        (
            b'--XyZ\r\nContent-Disposition: form-data; name="model"\r\n\r\nm1',
            b"multipart/form-data; boundary=XyZ",
            "without its closing boundary",
        ),
    ],
)
def test_form_field_says_what_is_wrong(body: bytes, ctype: bytes, words: str) -> None:
    with pytest.raises(ApiError) as caught:
        routes.form_field(body, ctype, "model")
    assert caught.value.status == 400
    assert words in caught.value.message


@pytest.mark.parametrize(
    ("path", "methods"),
    [
        ("/v1/responses", ("POST",)),
        ("/v1/messages", ("POST",)),
        ("/v1/audio/translations", ("POST",)),
        ("/v1/responses/resp_1", ("GET", "DELETE")),
        ("/v1/responses/resp_1/cancel", ("POST",)),
        ("/v1/responses/resp_1/input_items", ("GET",)),
        ("/v1/responses/resp_1/input_items?limit=1&order=desc", ("GET",)),
        ("/v1/responses/resp_1?include=x", ("GET", "DELETE")),
        ("/v1/responses/?limit=1", None),
        ("/v1/responses/", None),
        ("/v1/responses/resp_1/other", None),
        ("/v1/chat/completions", None),
        ("/v1/nothing", None),
    ],
)
def test_methods_for(path: str, methods: tuple[str, ...] | None) -> None:
    assert routes.methods_for(path) == methods


@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789=&%_-.", max_size=40))
def test_stored_call_keeps_the_query_apart_from_the_id(query: str) -> None:
    call = routes.stored_call(f"/v1/responses/resp_1/input_items?{query}")
    assert call == routes.StoredCall("resp_1", "/input_items", "?" + query)
    assert routes.stored_call("/v1/responses/resp_1") == routes.StoredCall("resp_1", "")


def test_anthropic_error_shape() -> None:
    err = ApiError(404, "The model `x` does not exist", code="model_not_found")
    assert json.loads(routes.error_body("/v1/messages", err)) == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "The model `x` does not exist"},
    }
    assert json.loads(routes.error_body("/v1/responses", err))["error"]["code"] == (
        "model_not_found"
    )


def test_only_replicas_that_serve_the_route_are_candidates() -> None:
    from llmgw_router.endpoints import Endpoint, EndpointSpec
    from llmgw_router.proxy.prepare import serving

    def ep(name: str, routes: set[str]) -> Endpoint:
        return Endpoint(
            spec=EndpointSpec(name, f"http://{name}:1", ("m",), routes=frozenset(routes))
        )

    rerank, chat, unknown = (
        ep("a", {"/v1/rerank"}),
        ep("b", {"/v1/chat/completions"}),
        ep("c", set()),
    )
    assert serving((rerank, chat, unknown), "/v1/rerank", "m") == (rerank, unknown)
    with pytest.raises(ApiError) as caught:
        serving((chat,), "/v1/rerank", "m")
    assert caught.value.status == 404
    assert caught.value.code == "route_not_served"
    assert "/v1/rerank" in caught.value.message
    assert "`m`" in caught.value.message


def test_engine_errors_on_messages_are_in_anthropic_shape() -> None:
    from llmgw_router.errors import error_body as openai_body

    body = openai_body("upstream failed for model `m`: connect", "upstream_error", None, "connect")
    assert json.loads(routes.in_shape("/v1/messages", 502, body)) == {
        "type": "error",
        "error": {"type": "api_error", "message": "upstream failed for model `m`: connect"},
    }
    assert json.loads(routes.in_shape("/v1/messages", 529, b"not json"))["error"] == {
        "type": "overloaded_error",
        "message": "upstream answered 529",
    }
    assert routes.in_shape("/v1/responses", 502, body) == body
