"""An engine's error answer in OpenAI's shape, the shape of the router's own errors.

vLLM and SGLang answer `{"object": "error", "message", "type", "param", "code"}`,
llama.cpp `{"error": {"code", "message", "type"}}`, a FastAPI route `{"detail": ...}`,
and a proxy in between may answer plain text. Clients get one shape whatever served
them: `{"error": {"message", "type", "param", "code"}}` (llmgw_router.errors), with
the engine's message, its type when it is spelt as OpenAI's are (`snake_case`),
otherwise `invalid_request_error` for a 4xx and `upstream_error` for a 5xx, and its
code when it is a word (a number only repeats the HTTP status).
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from llmgw_router.errors import error_body

__all__ = ["openai_error", "other_headers"]

_TYPE = re.compile(r"[a-z][a-z0-9_]{0,63}")
_MAX_MESSAGE = 2000


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, bool | int | float):
        return str(value)
    return msgspec.json.encode(value).decode()


def openai_error(status: int, payload: bytes) -> bytes:
    """The body to send for an engine's error answer ``payload`` with ``status``."""
    default_type = "upstream_error" if status >= 500 else "invalid_request_error"
    try:
        data: Any = msgspec.json.decode(payload)
    except msgspec.DecodeError:
        data = None
    detail: dict[str, Any] = {}
    if isinstance(data, dict):
        inner = data.get("error")
        if isinstance(inner, dict):
            detail = inner
        elif isinstance(inner, str):
            detail = {"message": inner}
        elif "message" in data:
            detail = data
        elif "detail" in data:
            detail = {"message": data["detail"]}
    message = _text(detail.get("message"))
    if not message:
        text = payload.decode("utf-8", "replace").strip()
        message = text or f"the engine answered {status} with no message"
    kind = detail.get("type")
    type_ = kind if isinstance(kind, str) and _TYPE.fullmatch(kind) else default_type
    # OpenAI's codes are words (model_not_found); an engine's number repeats the status.
    code = detail.get("code")
    return error_body(
        message[:_MAX_MESSAGE],
        type_,
        _text(detail.get("param")),
        code if isinstance(code, str) and code else None,
    )


# What the rewritten body makes untrue, or the relay writes itself.
_BODY_HEADERS = frozenset({b"content-type", b"content-length", b"transfer-encoding"})


def other_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """An engine's error headers that still hold for the rewritten body (retry-after, ...)."""
    return [(k, v) for k, v in headers if k.lower() not in _BODY_HEADERS]
