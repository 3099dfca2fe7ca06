"""A real OTLP/HTTP trace receiver for tests: ``POST /v1/traces`` with a protobuf
``ExportTraceServiceRequest`` (what OpenTelemetry's OTLP/HTTP exporter sends), decoded
with ``opentelemetry-proto``, the spans kept for the test to read.

    with OtlpReceiver() as otlp:
        ... start a program with tracing.endpoint = otlp.url ...
        spans = otlp.wait_for_spans(lambda s: "llmgw.request" in names(s))

It listens on a free loopback port in a thread of the test process; the programs
under test reach it over a real socket, as they would a collector.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from llmgw_testkit import wait_for

__all__ = ["OtlpReceiver", "Span"]


@dataclass(frozen=True)
class Span:
    """One received span; ids as lower-case hex (``parent_id`` "" for a root)."""

    name: str
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    # (trace id, span id) of each link.
    links: tuple[tuple[str, str], ...]
    start_ns: int
    end_ns: int
    failed: bool
    events: tuple[str, ...] = field(default=())


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def decode(body: bytes) -> list[Span]:
    """The spans of one ``ExportTraceServiceRequest``."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    out = []
    for resource_spans in request.resource_spans:
        service = ""
        for attr in resource_spans.resource.attributes:
            if attr.key == "service.name":
                service = str(_value(attr.value))
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                out.append(
                    Span(
                        name=s.name,
                        service=service,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        links=tuple((lk.trace_id.hex(), lk.span_id.hex()) for lk in s.links),
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        failed=s.status.code == 2,
                        events=tuple(e.name for e in s.events),
                    )
                )
    return out


class OtlpReceiver:
    """An OTLP/HTTP receiver on a free loopback port; :attr:`url` is its endpoint."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        receiver = self
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self.requests = 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length)
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                spans = decode(body)
                with receiver._lock:
                    receiver._spans.extend(spans)
                    receiver.requests += 1
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def wait_for_spans(
        self, done: Callable[[list[Span]], bool], timeout: float = 60.0, what: str = "spans"
    ) -> list[Span]:
        """The spans received, once ``done`` says they are all in (or fail at the deadline)."""

        def check() -> list[Span] | None:
            spans = self.spans()
            return spans if done(spans) else None

        try:
            return wait_for(check, timeout=timeout, what=what)
        except TimeoutError as err:
            names = sorted({s.name for s in self.spans()})
            raise TimeoutError(f"{err}; spans received: {names}") from None

    def trace(self, trace_id: str) -> Iterator[Span]:
        return (s for s in self.spans() if s.trace_id == trace_id)
