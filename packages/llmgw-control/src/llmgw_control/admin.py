"""The admin HTTP responder: /healthz, /metrics, /v1/status, /v1/summary, /v1/explain/{model}.

A few GET routes on loopback do not justify a web framework in the control
plane's wheel: this is a small HTTP/1.1 responder on ``asyncio.start_server``,
one request per connection. The JSON it serves is built in
:mod:`llmgw_control.status`.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse
from typing import Any, Protocol

import msgspec
import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from llmgw_control import webpage

__all__ = ["AdminServer", "StatusSource"]

log = structlog.get_logger(__name__)

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}
_JSON = "application/json"


class StatusSource(Protocol):
    def status(self) -> dict[str, Any]: ...
    def summary(self) -> dict[str, Any]: ...
    def explain(self, model: str) -> dict[str, Any] | None: ...


class AdminServer:
    def __init__(
        self, source: StatusSource, registry: CollectorRegistry, *, insecure: bool = False
    ) -> None:
        self.source = source
        self.registry = registry
        # Shown on /healthz so nobody runs plaintext streams without noticing.
        self.insecure = insecure
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._handle, host, port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    def route(self, method: str, target: str) -> tuple[int, str, bytes]:
        """Status, content type and body for one request; pure of sockets."""
        if method not in ("GET", "HEAD"):
            return _error(405, f"{method} is not supported: use GET")
        path = urllib.parse.urlsplit(target).path
        if path in webpage.PATHS:  # the web status page, over /v1/status
            return webpage.page()
        if path == "/healthz":
            body = (
                b"ok (insecure: plaintext streams, peers not authenticated)\n"
                if self.insecure
                else b"ok\n"
            )
            return 200, "text/plain; charset=utf-8", body
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)
        if path == "/v1/status":
            return 200, _JSON, msgspec.json.encode(self.source.status())
        if path == "/v1/summary":
            return 200, _JSON, msgspec.json.encode(self.source.summary())
        if path.startswith("/v1/explain/"):
            model = urllib.parse.unquote(path.removeprefix("/v1/explain/"))
            found = self.source.explain(model)
            if found is None:
                return _error(404, f"model {model!r} is not in the catalog and has no replicas")
            return 200, _JSON, msgspec.json.encode(found)
        return _error(404, f"no such path {path!r}: try /, /v1/status, /v1/explain/MODEL, /metrics")

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10.0)
            request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
            parts = request_line.split(" ")
            if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
                status, ctype, body = _error(400, "malformed request line")
                method = "GET"
            else:
                method = parts[0]
                status, ctype, body = self.route(method, parts[1])
            headers = (
                f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
                f"Content-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n"
            )
            writer.write(headers.encode("latin-1") + (b"" if method == "HEAD" else body))
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass
        except Exception:
            log.exception("admin request failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


def _error(status: int, message: str) -> tuple[int, str, bytes]:
    return status, _JSON, msgspec.json.encode({"error": message})
