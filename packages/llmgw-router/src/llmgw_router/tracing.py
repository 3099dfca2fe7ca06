"""The router's tracing API (OpenTelemetry; llmgw_proto.tracing does the work).

Off unless the config's ``tracing.endpoint`` is set; off, every call is a no-op whose
cost is a function call and a boolean check. Any stage of the request path may use:

    from llmgw_router import tracing

    with tracing.span("llmgw.admission", tenant=name) as s:
        ...
        s.set(verdict="queued")          # more attributes
        s.event("resumed", offset=n)     # a point in time within the span
        s.fail("over quota")             # marks the span failed (an exception does too)

A span is a child of the current one: inside a request, of the request's span
(``llmgw.request``), whose attributes name the key, the model, the balancer and its
reason, the status and the tokens; ``tracing.current().set(...)`` adds to the current
span (the request's, outside any child); ``tracing.record(name, seconds)`` a finished
child that lasted ``seconds`` up to now. ``tracing.traceparent()`` is the current span's W3C
``traceparent`` (None when off), what the router sends the engine.
"""

from __future__ import annotations

from llmgw_proto.tracing import (
    NoSpan,
    TracingConfig,
    current,
    enabled,
    record,
    span,
    traceparent,
)

__all__ = ["NoSpan", "TracingConfig", "current", "enabled", "record", "span", "traceparent"]
