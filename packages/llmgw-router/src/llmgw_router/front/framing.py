"""HTTP framing errors answered like every other router error: OpenAI-shaped JSON.

A request the HTTP parser refuses (a bad chunk size, both Content-Length and
Transfer-Encoding, an unknown HTTP version, a header line without a colon) never
reaches the ASGI app; uvicorn answers it itself with a plain-text body. This protocol
is uvicorn's own httptools protocol with only that answer changed: a JSON error body
that names what the parser found, then the connection is closed.
"""

from __future__ import annotations

from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from llmgw_router.errors import error_body
from llmgw_router.request_id import new_id

__all__ = ["OpenAIErrorsProtocol", "framing_error_response"]


def framing_error_response(detail: str) -> bytes:
    """The whole HTTP/1.1 response for a request the parser refused."""
    reason = detail.strip().rstrip(".") or "malformed request"
    body = error_body(
        f"invalid HTTP request: {reason}", "invalid_request_error", None, "invalid_http_request"
    )
    head = (
        b"HTTP/1.1 400 Bad Request\r\n"
        b"content-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n"
        b"x-request-id: " + new_id() + b"\r\n"
        b"connection: close\r\n\r\n"
    )
    return head + body


class _Parser:
    """Wraps the C parser to remember why it refused the bytes it was fed."""

    __slots__ = ("error", "parser")

    def __init__(self, parser: Any) -> None:
        self.parser = parser
        self.error = ""

    def feed_data(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            raise
        except httptools.HttpParserError as err:
            self.error = str(err)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.parser, name)


class OpenAIErrorsProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.parser = _Parser(self.parser)  # type: ignore[assignment]

    def send_400_response(self, msg: str) -> None:
        parser = self.parser
        detail = parser.error if isinstance(parser, _Parser) and parser.error else msg
        self.transport.write(framing_error_response(detail))
        self.transport.close()
