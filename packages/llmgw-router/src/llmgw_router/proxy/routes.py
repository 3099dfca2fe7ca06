"""The routes beyond chat, completions and embeddings, and what each needs of the router.

Every one is routed by its model like the others, its body passed on untouched unless
said here, its answer (streamed or not) passed back:

- JSON bodies with a ``model``: ``/v1/responses``, ``/v1/messages`` (Anthropic's
  Messages API: the router's own errors there are in Anthropic's shape), ``/v1/rerank``,
  ``/rerank``, ``/v2/rerank``, ``/v1/score``, ``/tokenize``, ``/detokenize``,
  ``/pooling``, ``/classify``;
- multipart form bodies with the model in a form field: ``/v1/audio/transcriptions``,
  ``/v1/audio/translations`` (:func:`form_field`, bounded by the body limit the router
  already applies);
- stored responses: ``GET``/``DELETE /v1/responses/{id}``, ``GET
  /v1/responses/{id}/input_items`` and ``POST /v1/responses/{id}/cancel``, and a
  ``previous_response_id``, which must reach the replica that stored the response. The
  router gives clients response ids that name that replica (:func:`encode_id`: the
  engine's id, ``-llmgw-``, the endpoint id in base32), so any router of the fleet can
  send such a request where it belongs without shared state, and gives the engine its
  own id back (:func:`decode_id`). A client keeps the id as an opaque string, as
  OpenAI's API asks; it still starts with the engine's ``resp_``.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass

import msgspec

from llmgw_router.errors import ApiError

__all__ = [
    "FORM_ROUTES",
    "JSON_ROUTES",
    "MESSAGES_PATH",
    "RESPONSES_PATH",
    "STORED_PREFIX",
    "IdRewriter",
    "StoredCall",
    "anthropic_error_body",
    "decode_id",
    "encode_id",
    "error_body",
    "form_field",
    "in_shape",
    "methods_for",
    "stored_call",
]

RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"
JSON_ROUTES = frozenset(
    {
        RESPONSES_PATH,
        MESSAGES_PATH,
        "/v1/rerank",
        "/rerank",
        "/v2/rerank",
        "/v1/score",
        "/tokenize",
        "/detokenize",
        "/pooling",
        "/classify",
    }
)
FORM_ROUTES = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})
_POST = ("POST",)
_READ = ("GET", "DELETE")
_GET = ("GET",)
STORED_PREFIX = RESPONSES_PATH + "/"
_MARK = "-llmgw-"


def methods_for(path: str) -> tuple[str, ...] | None:
    """The methods a route of this module takes; None: not one of its routes."""
    if path in JSON_ROUTES or path in FORM_ROUTES:
        return _POST
    call = stored_call(path)
    if call is None:
        return None
    return {"": _READ, "/cancel": _POST, "/input_items": _GET}[call.action]


# ----- response ids ---------------------------------------------------------


def encode_id(engine_id: str, endpoint_id: str) -> str:
    """The id a client gets for the engine's ``engine_id`` stored at ``endpoint_id``."""
    tag = base64.b32encode(endpoint_id.encode()).decode("ascii").rstrip("=").lower()
    return f"{engine_id}{_MARK}{tag}"


def decode_id(value: str) -> tuple[str, str] | None:
    """(the engine's id, the endpoint id) of an id :func:`encode_id` made; None when
    ``value`` is not one."""
    engine_id, mark, tag = value.rpartition(_MARK)
    if not mark or not engine_id or not tag:
        return None
    try:
        raw = base64.b32decode(tag.upper() + "=" * (-len(tag) % 8))
        return engine_id, raw.decode()
    except (binascii.Error, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class StoredCall:
    """A call on a stored response: its id as the client sent it, and what follows it."""

    response_id: str
    action: str  # "", "/cancel" or "/input_items"
    query: str = ""  # "" or "?" and the query string as sent


def stored_call(path: str) -> StoredCall | None:
    """A stored response's call: its id, the action after it and the query string the
    client sent (``?include=...``, ``?limit=...``; passed on to the engine as sent)."""
    if not path.startswith(STORED_PREFIX):
        return None
    rest, mark, query = path[len(STORED_PREFIX) :].partition("?")
    response_id, slash, action = rest.partition("/")
    if not response_id or (slash and action not in ("cancel", "input_items")):
        return None
    return StoredCall(response_id, "/" + action if slash else "", mark + query)


# The response ids in an engine's answer: its own, and the previous one it names.
_ID_FIELD = re.compile(rb'"(id|previous_response_id|response_id)"(\s*:\s*)"(resp_[A-Za-z0-9_\-]+)"')


class IdRewriter:
    """Rewrites the response ids in one engine answer to ids that name its endpoint.

    :meth:`whole` for a JSON body; :meth:`feed` / :meth:`flush` for a stream, which is
    rewritten event by event (up to each blank line), so an id split across two reads
    is still found.
    """

    __slots__ = ("_pending", "endpoint_id")

    def __init__(self, endpoint_id: str) -> None:
        self.endpoint_id = endpoint_id
        self._pending = b""

    def _swap(self, m: re.Match[bytes]) -> bytes:
        value = m.group(3).decode("ascii")
        if _MARK in value:
            return m.group(0)
        new = encode_id(value, self.endpoint_id).encode("ascii")
        return b'"' + m.group(1) + b'"' + m.group(2) + b'"' + new + b'"'

    def whole(self, body: bytes) -> bytes:
        return _ID_FIELD.sub(self._swap, body)

    def feed(self, data: bytes) -> bytes:
        data = self._pending + data
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return b""
        self._pending = data[end + 2 :]
        return self.whole(data[: end + 2])

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return self.whole(rest)


class _Previous(msgspec.Struct):
    previous_response_id: str | None = None


_decode_previous = msgspec.json.Decoder(_Previous).decode


def previous_response(body: bytes) -> tuple[str, str, bytes] | None:
    """A ``/v1/responses`` body's ``previous_response_id`` when it names a replica:
    (the endpoint id, the engine's id, the body with the engine's id in its place)."""
    if b"previous_response_id" not in body:
        return None
    try:
        value = _decode_previous(body).previous_response_id
    except msgspec.DecodeError:
        return None  # parse_head reports what is wrong with the body
    if value is None:
        return None
    decoded = decode_id(value)
    if decoded is None:
        return None
    engine_id, endpoint_id = decoded
    old, new = msgspec.json.encode(value), msgspec.json.encode(engine_id)
    return endpoint_id, engine_id, body.replace(old, new)


def unknown_response(response_id: str) -> ApiError:
    return ApiError(
        404,
        f"No response with id `{response_id}`: it was not given out by this fleet's routers",
        param="response_id",
        code="response_not_found",
    )


# ----- multipart form bodies ------------------------------------------------

_MAX_PART_HEAD = 16 * 1024
_BOUNDARY = re.compile(r'boundary=(?:"([^"]{1,70})"|([^\s;"]{1,70}))', re.IGNORECASE)
_NAME = re.compile(rb'\bname="([^"]*)"', re.IGNORECASE)


def form_field(body: bytes, content_type: bytes, name: str) -> str | None:
    """A text field of a ``multipart/form-data`` body (None: no such field); ApiError
    (400) naming what is wrong when the body is not such a form. Reads only the parts'
    heads and the field's value, never more than the body (which the router's
    ``max_body_bytes`` already bounds)."""
    ctype = content_type.decode("latin-1")
    if not ctype.lower().startswith("multipart/form-data"):
        raise ApiError(
            400,
            f"this route takes a multipart/form-data body, not `{ctype or 'none'}`",
            param="content-type",
            code="invalid_request",
        )
    m = _BOUNDARY.search(ctype)
    if m is None:
        raise ApiError(
            400,
            "the content-type multipart/form-data has no boundary",
            param="content-type",
            code="invalid_request",
        )
    delimiter = b"--" + (m.group(1) or m.group(2)).encode("latin-1")
    at = body.find(delimiter)
    if at < 0:
        raise ApiError(
            400,
            "the multipart body does not contain its boundary",
            code="invalid_request",
        )
    wanted = name.encode()
    while True:
        at += len(delimiter)
        if body[at : at + 2] == b"--":
            return None  # the closing delimiter
        head_end = body.find(b"\r\n\r\n", at, at + _MAX_PART_HEAD)
        if head_end < 0:
            raise ApiError(
                400,
                "a part of the multipart body has no end to its headers"
                f" within {_MAX_PART_HEAD} bytes",
                code="invalid_request",
            )
        head = body[at:head_end]
        next_at = body.find(b"\r\n" + delimiter, head_end + 4)
        if next_at < 0:
            raise ApiError(
                400, "the multipart body ends without its closing boundary", code="invalid_request"
            )
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-disposition:"):
                found = _NAME.search(line)
                if found is not None and found.group(1) == wanted:
                    value = body[head_end + 4 : next_at]
                    try:
                        return value.decode()
                    except UnicodeDecodeError:
                        raise ApiError(
                            400,
                            f"the form field `{name}` is not UTF-8 text",
                            param=name,
                            code="invalid_request",
                        ) from None
        at = next_at + 2


# ----- Anthropic's error shape ----------------------------------------------

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> bytes:
    """``{"type": "error", "error": {"type", "message"}}``, as Anthropic's API answers."""
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return msgspec.json.encode({"type": "error", "error": {"type": kind, "message": message}})


class _OpenAIError(msgspec.Struct):
    class Detail(msgspec.Struct):
        message: str = ""

    error: Detail = msgspec.field(default_factory=Detail)


def in_shape(path: str, status: int, openai_body: bytes) -> bytes:
    """An OpenAI-shaped error body as written on ``path`` (Anthropic's on /v1/messages)."""
    if path != MESSAGES_PATH:
        return openai_body
    try:
        message = msgspec.json.decode(openai_body, type=_OpenAIError).error.message
    except msgspec.DecodeError:
        message = ""
    return anthropic_error_body(status, message or f"upstream answered {status}")


def error_body(path: str, err: ApiError) -> bytes:
    """The router's own error ``err`` as written on ``path``: Anthropic's shape on
    ``/v1/messages``, OpenAI's everywhere else."""
    if path == MESSAGES_PATH:
        return anthropic_error_body(err.status, err.message)
    return err.body()
