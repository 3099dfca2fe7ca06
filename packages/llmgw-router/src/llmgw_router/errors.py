"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import msgspec

__all__ = ["ApiError", "error_body", "sse_error_event"]


class _Detail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class _Body(msgspec.Struct):
    error: _Detail


_ENCODER = msgspec.json.Encoder()


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> bytes:
    return _ENCODER.encode(_Body(_Detail(message, type_, param, code)))


def sse_error_event(message: str, code: str) -> bytes:
    """What ends a stream that fails after its first byte: an error event, then `[DONE]`."""
    return b"data: " + error_body(message, "upstream_error", None, code) + b"\n\ndata: [DONE]\n\n"


class ApiError(Exception):
    """An error answer to the client, raised anywhere before the response starts."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        *,
        param: str | None = None,
        code: str | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
        model: str = "",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or []
        # A model the router knows (no endpoint now, held too long): what the request
        # is counted under in llmgw_router_requests_total; "" for any other refusal.
        self.model = model

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.param, self.code)
