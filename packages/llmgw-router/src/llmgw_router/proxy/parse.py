"""Stage 2, parse: the few fields the router reads from a request body.

Only `model`, `stream`, `user` and the completion's bounds (`max_tokens`,
`max_completion_tokens`) are decoded, and for the cache-aware balancer the
raw JSON text of `messages` or `prompt` (not decoded); the rest of the body passes to
the engine untouched. A body that does not parse is a 400 naming what is wrong.
"""

from __future__ import annotations

from typing import Any

import msgspec

from llmgw_router.errors import ApiError

__all__ = ["RequestHead", "RequestHeadWithPrompt", "parse_head"]


class RequestHead(msgspec.Struct):
    """The few fields the router reads from a request body; the rest passes untouched."""

    model: str
    stream: bool = False
    user: str | None = None
    # The completion's bounds, as sent (any JSON value; the engine judges them), for the
    # tokens admission reserves (tenants/estimate.py): read here so the body is read once.
    max_tokens: Any = None
    max_completion_tokens: Any = None


class RequestHeadWithPrompt(RequestHead):
    """The same, plus the prompt's raw JSON text (not decoded) for prefix affinity."""

    messages: msgspec.Raw = msgspec.Raw()
    prompt: msgspec.Raw = msgspec.Raw()


_decode_head = msgspec.json.Decoder(RequestHead).decode
_decode_head_with_prompt = msgspec.json.Decoder(RequestHeadWithPrompt).decode


def parse_head(body: bytes, with_prompt: bool) -> RequestHead:
    """The request's head fields, or an ApiError (400) that says what is wrong."""
    try:
        if with_prompt:
            return _decode_head_with_prompt(body)
        return _decode_head(body)
    except RecursionError:
        # msgspec gives up on very deep nesting (any field, skipped or not).
        raise ApiError(
            400,
            "the request body is nested too deeply to be valid JSON for this API",
            code="invalid_json",
        ) from None
    except msgspec.ValidationError as err:
        text = str(err)
        param = (
            "model"
            if "model" in text
            else "stream"
            if "stream" in text
            else "user"
            if "user" in text
            else None
        )
        if text.startswith("Expected `object`"):
            text, param = "the request body must be a JSON object", None
        raise ApiError(
            400, f"invalid request body: {text}", param=param, code="invalid_request"
        ) from None
    except msgspec.DecodeError as err:
        raise ApiError(
            400, f"the request body is not valid JSON: {err}", code="invalid_json"
        ) from None
