"""OpenTelemetry traces for every llmgw program: off by default, free when off.

A program reads a :class:`TracingConfig` (its config file's ``tracing:`` section) and
calls :func:`configure` once at start; with no ``endpoint`` nothing is imported and
:func:`span` hands back one shared do-nothing span, so the cost of a traced spot is a
function call and a boolean check. With an endpoint, spans are batched and exported
over OTLP/HTTP (protobuf) to ``<endpoint>/v1/traces``.

The API every program uses:

- ``with span("name", attr=value, parent=traceparent, links=(traceparent, ...)) as s:``
  a span, child of the current one (or of ``parent``, a W3C ``traceparent`` carried
  from another process), linked to ``links``; ``s.set(key=value)`` adds attributes,
  ``s.event(name, **attrs)`` an event, ``s.fail(message)`` marks it failed. An
  exception leaving the block marks it failed too.
- ``traceparent()``: the current span's W3C ``traceparent`` (None when off or outside
  a span), to carry in a header or a message so the next process continues the trace.
- ``enabled()``: whether spans are recorded at all.

Attribute values are str, bool, int or float; None values are left out.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from llmgw_proto.config import BaseConfig, ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

__all__ = [
    "TracingConfig",
    "check_config",
    "configure",
    "current",
    "enabled",
    "parse_traceparent",
    "record",
    "shutdown",
    "span",
    "traceparent",
    "use_provider",
]


class TracingConfig(BaseConfig):
    """The ``tracing:`` section: where spans go (empty endpoint: tracing off)."""

    # OTLP/HTTP collector, e.g. http://127.0.0.1:4318 (spans POSTed to /v1/traces).
    endpoint: str = ""
    # The service.name resource attribute; empty: the program's name.
    service_name: str = ""
    # The share of new traces recorded (a trace begun upstream keeps its caller's choice).
    sample_ratio: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 1.0
    # Extra HTTP headers on every export (an auth token, say).
    headers: dict[str, str] = msgspec.field(default_factory=dict)


def check_config(cfg: TracingConfig, source: str, field: str = "$.tracing") -> None:
    """A ConfigError naming ``field.endpoint`` unless it is empty or an http(s) URL."""
    endpoint = cfg.endpoint
    if not endpoint:
        return
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(endpoint)
        port = parts.port
    except ValueError as err:
        raise ConfigError(source, f"not a URL: {err}", f"{field}.endpoint") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            source,
            f"{endpoint!r} is not an OTLP/HTTP URL (http://host:port or https://host:port)",
            f"{field}.endpoint",
        )
    del port


_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def parse_traceparent(value: str) -> tuple[int, int, bool] | None:
    """A W3C ``traceparent``'s (trace id, span id, sampled), or None when it is not one
    (wrong shape, version ff, all-zero ids)."""
    m = _TRACEPARENT.match(value.strip().lower())
    if m is None or m.group(1) == "ff":
        return None
    trace_id, span_id = int(m.group(2), 16), int(m.group(3), 16)
    if trace_id == 0 or span_id == 0:
        return None
    return trace_id, span_id, bool(int(m.group(4), 16) & 1)


def format_traceparent(trace_id: int, span_id: int, sampled: bool) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


class NoSpan:
    """The span :func:`span` gives when tracing is off: every method does nothing."""

    __slots__ = ()

    def set(self, **attrs: object) -> None:
        pass

    def event(self, name: str, **attrs: object) -> None:
        pass

    def fail(self, message: str) -> None:
        pass

    def traceparent(self) -> str | None:
        return None


class _NoSpanContext:
    __slots__ = ()

    def __enter__(self) -> NoSpan:
        return _NO_SPAN

    def __exit__(self, *exc: object) -> None:
        return None


_NO_SPAN = NoSpan()
_NO_CONTEXT = _NoSpanContext()


def _clean(attrs: dict[str, object]) -> dict[str, Any]:
    return {k: v for k, v in attrs.items() if v is not None}


class LiveSpan(NoSpan):
    """A recorded span."""

    __slots__ = ("_span",)

    def __init__(self, span: Span) -> None:
        self._span = span

    def set(self, **attrs: object) -> None:
        self._span.set_attributes(_clean(attrs))

    def event(self, name: str, **attrs: object) -> None:
        self._span.add_event(name, _clean(attrs))

    def fail(self, message: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self._span.set_status(Status(StatusCode.ERROR, message))

    def traceparent(self) -> str | None:
        sc = self._span.get_span_context()
        if not sc.is_valid:
            return None
        return format_traceparent(sc.trace_id, sc.span_id, sc.trace_flags.sampled)


_tracer: Tracer | None = None
_provider: TracerProvider | None = None


def enabled() -> bool:
    return _tracer is not None


def configure(cfg: TracingConfig | None, program: str) -> None:
    """Start exporting spans as ``cfg`` says (no endpoint: off, nothing imported)."""
    if cfg is None or not cfg.endpoint:
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio

    url = cfg.endpoint.rstrip("/")
    if not url.endswith("/v1/traces"):
        url += "/v1/traces"
    provider = TracerProvider(
        resource=Resource.create({"service.name": cfg.service_name or program}),
        sampler=ParentBasedTraceIdRatio(cfg.sample_ratio),
    )
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=url, headers=dict(cfg.headers)))
    )
    use_provider(provider)


def use_provider(provider: TracerProvider) -> None:
    """Record spans with ``provider`` (configure's; a test's own, with its exporter)."""
    global _tracer, _provider
    _provider = provider
    _tracer = provider.get_tracer("llmgw")


def shutdown() -> None:
    """Export what is buffered and stop (at the program's exit)."""
    global _tracer, _provider
    provider = _provider
    _tracer = _provider = None
    if provider is not None:
        provider.shutdown()


def _remote(value: str | None) -> Any:
    """A remote parent's SpanContext from a traceparent (None: not one)."""
    if not value:
        return None
    parsed = parse_traceparent(value)
    if parsed is None:
        return None
    from opentelemetry.trace import SpanContext, TraceFlags

    trace_id, span_id, sampled = parsed
    return SpanContext(
        trace_id,
        span_id,
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT),
    )


@contextlib.contextmanager
def _live(
    tracer: Tracer, name: str, parent: str | None, links: Sequence[str], attrs: dict[str, object]
) -> Iterator[LiveSpan]:
    from opentelemetry.trace import Link, NonRecordingSpan, set_span_in_context

    context = None
    remote = _remote(parent)
    if remote is not None:
        context = set_span_in_context(NonRecordingSpan(remote))
    span_links = [Link(sc) for sc in (_remote(v) for v in links) if sc is not None]
    with tracer.start_as_current_span(
        name, context=context, links=span_links, attributes=_clean(attrs)
    ) as otel_span:
        yield LiveSpan(otel_span)


def span(
    name: str, *, parent: str | None = None, links: Sequence[str] = (), **attrs: Any
) -> contextlib.AbstractContextManager[NoSpan]:
    """A span around a block (see the module's doc); a shared no-op when tracing is off."""
    tracer = _tracer
    if tracer is None:
        return _NO_CONTEXT
    return _live(tracer, name, parent, links, attrs)


def record(name: str, seconds: float, *, parent: str | None = None, **attrs: Any) -> str | None:
    """A finished span that ends now and lasted ``seconds`` (a wait measured on the way,
    such as the time to an engine's first byte), a child of the current span or of
    ``parent`` (a traceparent); its own traceparent (None when off)."""
    tracer = _tracer
    if tracer is None:
        return None
    import time

    from opentelemetry.trace import NonRecordingSpan, set_span_in_context

    remote = _remote(parent)
    context = set_span_in_context(NonRecordingSpan(remote)) if remote is not None else None
    end = time.time_ns()
    child = tracer.start_span(
        name,
        context=context,
        start_time=end - int(max(0.0, seconds) * 1e9),
        attributes=_clean(attrs),
    )
    child.end(end_time=end)
    sc = child.get_span_context()
    return format_traceparent(sc.trace_id, sc.span_id, sc.trace_flags.sampled)


def current() -> NoSpan:
    """The current span (to add attributes to); the no-op span when off or outside one."""
    if _tracer is None:
        return _NO_SPAN
    from opentelemetry.trace import get_current_span

    return LiveSpan(get_current_span())


def traceparent() -> str | None:
    """The current span's W3C traceparent; None when off or outside any span."""
    if _tracer is None:
        return None
    from opentelemetry.trace import get_current_span

    sc = get_current_span().get_span_context()
    if not sc.is_valid:
        return None
    return format_traceparent(sc.trace_id, sc.span_id, sc.trace_flags.sampled)
