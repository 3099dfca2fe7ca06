"""The composition of the request path: one request through its stages.

    admit → parse → route → choose → exchange (→ relay)

- admit (admit.py): route, method, API key, draining, body size; `/v1/models`;
- parse (parse.py): `model`, `stream`, `user` (and the raw prompt) from the body;
- route (route.py): the model's candidate endpoints (held while a scale-to-zero model
  has none), its deadlines, the headers an engine gets: the :class:`RequestContext`;
- choose (choose.py): what the balancer keys on, read once; the pick per attempt;
- exchange (exchange.py): attempts until one gets a first byte, retried as retry.py
  decides; then
- relay (relay.py): the response passed on chunk by chunk, usage counted.

Each stage is an object with one concern, built once from the router's state; this
module only wires them and keeps the request's one exit, where its outcome is counted
(:meth:`ProxyApp.count`). A new concern (admission control, a two-phase prefill/decode
exchange, a resumed stream, a new route) is a new or replaced stage here, not a
branch inside another.

Two servers feed it: the router's own HTTP/1.1 protocol (protocol.py) calls
:meth:`ProxyApp.serve_request` with a request read whole, and
:meth:`ProxyApp.admit` on its head first; any ASGI server calls the app itself
(asgi.py). Both answer through a :class:`Reply`. A client that goes away cancels the
request, which closes the upstream connection and so ends the engine's work at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from structlog.contextvars import bind_contextvars

from llmgw_router import tracing
from llmgw_router.config import ApiKey
from llmgw_router.errors import ApiError
from llmgw_router.front.reply import HttpRequest
from llmgw_router.proxy import traced
from llmgw_router.proxy.admit import MODELS_PATH, PROXIED_PATHS, Admission, too_large
from llmgw_router.proxy.asgi import Receive, Scope, Send, serve_asgi
from llmgw_router.proxy.choose import Chooser
from llmgw_router.proxy.context import Headers, Incoming, Outcome, Reply, RequestContext, respond
from llmgw_router.proxy.exchange import Exchange
from llmgw_router.proxy.parse import RequestHeadWithPrompt, parse_head
from llmgw_router.proxy.prepare import pin, prepare
from llmgw_router.proxy.route import Router
from llmgw_router.proxy.routes import error_body
from llmgw_router.proxy.warm import Warmer
from llmgw_router.state import RouterState, now
from llmgw_router.tenants.gate import Tenancy
from llmgw_router.tenants.reply import WithHeaders
from llmgw_router.upstream import Pool

__all__ = ["ProxyApp"]

log = structlog.get_logger(__name__)


class ProxyApp:
    """The OpenAI routes: :meth:`serve_request` for the router's own server, ASGI otherwise."""

    def __init__(
        self,
        state: RouterState,
        pool: Pool | None = None,
        api_keys: tuple[ApiKey, ...] = (),
        workers: int = 1,
    ) -> None:
        self.state = state
        self.pool = pool
        # Per-key limits, shares and the fair-share queue (tenants/).
        self.tenancy = Tenancy(state, state.config.tenants, workers)
        state.tenants = self.tenancy
        self.admission = Admission(state, api_keys, self.tenancy)
        self.router = Router(state)
        self.chooser = Chooser(state)
        if pool is not None and self.chooser.cache_aware:
            # A drain that keeps the cache warm (issue 28): proxy/warm.py.
            self.chooser.warmer = Warmer(state, pool, state.config.warming)
        self._with_prompt = self.chooser.cache_aware
        self._exchange = Exchange(state, pool, self.chooser)
        self.holds = self.router.holds
        # Tracing is configured before the app is built (server.serve): off, no request
        # pays more than reading this flag.
        self._traced = tracing.enabled()
        if self._traced:
            self.serve_request = self._serve_traced  # type: ignore[method-assign]

    def set_keys(self, keys: tuple[ApiKey, ...]) -> None:
        """New API keys (SIGHUP re-read the keys file): the next request is checked on them."""
        self.admission.keys = keys

    def admit(self, method: str, path: str, headers: Headers) -> ApiKey | None:
        """Route and key checks on a request's head alone (the router's own server runs
        them before it reads the body): the caller's key (None: open access), or an
        ApiError."""
        return self.admission.admit(method, path, headers)

    async def _serve_traced(self, request: Incoming) -> None:
        with traced.request_span(request.method, request.path, request.headers):
            await ProxyApp.serve_request(self, request)

    async def serve_request(self, request: Incoming) -> None:
        """One request read whole by the router's own HTTP server, answered to the end."""
        outcome = Outcome()
        try:
            if request.refusal is not None:
                raise request.refusal
            api_key = request.api_key
            admission = self.admission
            if request.path == MODELS_PATH:
                await respond(request, 200, admission.models_body(api_key))
            else:
                admission.check_draining()
                if request.too_large:
                    raise too_large(self.state.config.max_body_bytes, request.declared_length)
                ctx = await self.context(
                    request.path, request.headers, request.content, api_key, request.method
                )
                await self.exchange(ctx, request, outcome)
        except ApiError as err:
            outcome.error_status, outcome.error_model = err.status, err.model
            await respond(request, err.status, error_body(request.path, err), err.headers)
        except asyncio.CancelledError:
            # The client went away while the request waited (held, say): nothing to answer.
            if not request.gone or request.task is None:
                raise
            request.task.uncancel()
        finally:
            self.count(outcome)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._traced and scope["type"] == "http":
            headers = traced.asgi_headers(scope)
            with traced.request_span(scope["method"], scope["path"], headers):
                await serve_asgi(self, scope, receive, send)
        else:
            await serve_asgi(self, scope, receive, send)

    async def context(
        self,
        path: str,
        headers: Headers,
        body: bytes,
        api_key: ApiKey | None,
        method: str = "POST",
    ) -> RequestContext:
        """parse → route → the balancer's keys: the request's context, or an ApiError
        (for a limited key, with its x-ratelimit-* headers).
        Only a held request or a prompt to tokenize waits here."""
        if api_key is not None:
            # The key's name on every log line of this request (its own task) from here.
            bind_contextvars(key=api_key.name)
        try:
            return await self._context(path, headers, body, api_key, method)
        except ApiError as err:
            if api_key is not None:
                self.tenancy.error_headers(err, api_key)
            raise

    async def _context(
        self, path: str, headers: Headers, body: bytes, api_key: ApiKey | None, method: str
    ) -> RequestContext:
        started = now()
        prepared = None
        if path in PROXIED_PATHS:
            head = parse_head(body, self._with_prompt)
        else:
            # The routes of routes.py: responses, messages, rerank, audio, ...
            prepared = prepare(method, path, headers, body, self.state, self._with_prompt)
            if prepared is None:
                raise ApiError(404, f"no route {method} {path}", code="not_found")
            head, path, body = prepared.head, prepared.path, prepared.body
        model = head.model
        router = self.router
        ctx = router.context(path, headers, body, model, api_key, started)
        if ctx is None:
            endpoints = await router.wait_for(model)
            ctx = router.context_over(path, headers, body, model, endpoints, started)
        if prepared is not None:
            pin(ctx, prepared, self.state)
        tokenizer = self.chooser.read_keys(ctx, headers, head)
        if tokenizer is not None:
            assert isinstance(head, RequestHeadWithPrompt)
            await self.chooser.read_tokens(ctx, head, tokenizer)
        tenancy = self.tenancy
        if api_key is not None or tenancy.queue_on:
            # The body's own head (a route of routes.py sends another body).
            parsed = head if prepared is None else None
            # Last, so that nothing between here and exchange() can fail: its finally
            # gives the ticket back.
            if self._traced:
                attrs: dict[str, Any] = {"llmgw.key": api_key and api_key.name}
                with tracing.span("llmgw.admission", **attrs):
                    ctx.tenant = await tenancy.admit(
                        api_key, model, ctx.candidates, body, parsed, ctx.tokens
                    )
            else:
                ctx.tenant = await tenancy.admit(
                    api_key, model, ctx.candidates, body, parsed, ctx.tokens
                )
        if self._traced:
            traced.on_context(api_key, ctx, self.state.config.balancer)
        return ctx

    async def exchange(self, ctx: RequestContext, reply: Reply, outcome: Outcome) -> None:
        """choose → exchange → relay, counted in flight; a client gone is no error."""
        state = self.state
        state.in_flight += 1
        outcome.ctx = ctx
        ticket = ctx.tenant
        # The router's own request whose head carries the key's lines, if any.
        late: HttpRequest | None = None
        if ticket is not None and ticket.state is not None:
            if type(reply) is HttpRequest:
                # The router's own server writes the key's x-ratelimit-* lines into the
                # head as one block made as it goes out (no wrapper, no list to join).
                late = reply
                late.late_head = ticket.state
            else:
                reply = WithHeaders(reply, ticket.state)
        try:
            await self._exchange.serve(ctx, reply)
        except ApiError as err:
            ctx.status = ctx.status or err.status
            if ticket is not None and ticket.state is not None:
                # The router's own 502/503/504: a limited key's headers too (in the
                # error's own list: not twice).
                if late is not None:
                    late.late_head = None
                err.headers = [*err.headers, *self.tenancy.headers(ticket)]
            raise
        except asyncio.CancelledError:
            if not reply.gone or reply.task is None:
                raise
            # The client went away: the upstream request is closed by now; nothing to answer.
            reply.task.uncancel()
            state.metrics.child(state.metrics.client_disconnects, ctx.model).inc()
            log.info("client disconnected", model=ctx.model, after=round(now() - ctx.started, 3))
        finally:
            state.in_flight -= 1
            if ticket is not None:
                prompt, completion = ctx.usage if ctx.usage is not None else (None, None)
                self.tenancy.done(ticket, prompt, completion, ctx.status)

    def count(self, outcome: Outcome) -> None:
        """The one place request metrics are recorded."""
        if self._traced:
            traced.on_count(outcome)
        metrics = self.state.metrics
        ctx = outcome.ctx
        if ctx is not None and ctx.status:
            metrics.child(metrics.requests, ctx.model, str(ctx.status), ctx.endpoint).inc()
            metrics.child(metrics.duration, ctx.model).observe(now() - ctx.started)
        elif outcome.error_status:
            # Labelled with a model only when the router knows it (ApiError.model): any
            # string a client sends would make a series of its own.
            model = outcome.error_model
            metrics.child(metrics.requests, model, str(outcome.error_status), "").inc()
