"""The request path's spans (llmgw_router.tracing), called only when tracing is on.

``llmgw.request`` (one per request, a child of the client's ``traceparent``): its route,
method, key name, model, balancer, the balancer's reason, the endpoint, status, retries
and tokens. Its children: ``llmgw.admission`` (tenants), ``llmgw.upstream`` (one per
attempt; ``llmgw.resume`` for an attempt that resumes a broken stream), and within each
attempt ``llmgw.first_byte`` (from sending to the engine's first byte). The engine gets
the attempt's ``traceparent``, so its own spans (vLLM's ``--otlp-traces-endpoint``) join
the trace.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from llmgw_router import tracing
from llmgw_router.config import ApiKey
from llmgw_router.proxy.context import Headers, Outcome, RequestContext

__all__ = ["on_context", "on_count", "request_span", "upstream_headers"]

_TRACEPARENT = b"traceparent"


def request_span(
    method: str, path: str, headers: Headers
) -> contextlib.AbstractContextManager[tracing.NoSpan]:
    given = headers.get(_TRACEPARENT)
    return tracing.span(
        "llmgw.request",
        parent=given.decode("latin-1") if given else None,
        **{"http.request.method": method, "http.route": path},
    )


def asgi_headers(scope: Mapping[str, Any]) -> Headers:
    headers: Headers = {}
    for key, value in scope.get("headers", ()):
        if bytes(key).lower() == _TRACEPARENT:
            headers[_TRACEPARENT] = bytes(value)
    return headers


def on_context(api_key: ApiKey | None, ctx: RequestContext, balancer: str) -> None:
    tracing.current().set(
        **{
            "llmgw.key": api_key.name if api_key is not None else None,
            "llmgw.model": ctx.model,
            "llmgw.balancer": balancer,
            "llmgw.candidates": len(ctx.candidates),
        }
    )


def on_count(outcome: Outcome) -> None:
    """The request's outcome, on its span (the one exit, ProxyApp.count)."""
    span = tracing.current()
    ctx = outcome.ctx
    if ctx is None or not ctx.status:
        span.set(**{"http.response.status_code": outcome.error_status or None})
        if outcome.error_status >= 500:
            span.fail(f"answered {outcome.error_status}")
        return
    prompt, completion = ctx.usage if ctx.usage is not None else (None, None)
    span.set(
        **{
            "http.response.status_code": ctx.status,
            "llmgw.endpoint": ctx.endpoint,
            "llmgw.pick_reason": ctx.pick_reason,
            "llmgw.retries": ctx.retries,
            "llmgw.attempts": len(ctx.tried),
            "llmgw.tokens.prompt": prompt,
            "llmgw.tokens.completion": completion,
        }
    )
    if ctx.status >= 500:
        span.fail(f"answered {ctx.status}")


def upstream_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The engine's headers with this attempt's traceparent in place of the client's."""
    mine = tracing.traceparent()
    if mine is None:
        return headers
    return [*(h for h in headers if h[0] != _TRACEPARENT), (_TRACEPARENT, mine.encode())]
