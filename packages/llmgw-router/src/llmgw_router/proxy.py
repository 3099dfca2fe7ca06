"""The OpenAI-facing proxy: a plain ASGI app on the request path.

Plain ASGI rather than a framework's Request/Response objects, because every
microsecond here is added to every request. One request:

1. read the body (bounded), decode only `model`, `stream` and `user` from it, and, for
   the cache-aware balancer, take the raw text of `messages` or `prompt` undecoded;
2. pick an endpoint of the model (profile pin or default profile first); a declared
   model with no endpoint yet (scale to zero) is held until one appears (hold.py);
3. send the body unchanged; wait for the response head and its first body chunk
   within `first_byte`. A failure up to here goes to another endpoint, as retry.py
   decides (retry count, deadline, 429, budget);
4. pass every further chunk on as it arrives; after the first byte a failure ends
   an SSE stream with an error event and `[DONE]`.

A client that goes away cancels the request, which closes the upstream connection and
so ends the engine's work at once.

Two servers feed it. The default is the router's own HTTP/1.1 protocol (protocol.py):
it parses the request itself and calls :meth:`ProxyApp.serve_request` with the whole
body, and sees a disconnect as the connection's loss. `server: hypercorn` runs the same
proxy as a plain ASGI app (``__call__``), where a task watches ``receive`` for the
disconnect. Both answer through a :class:`Reply` (``start``, then ``body`` until the
last).

Everything one request carries lives in one :class:`RequestContext`; its outcome is
counted in the request metrics at one place, when the request ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import math
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import structlog

from llmgw_router.config import ApiKey, Deadlines
from llmgw_router.endpoints import Endpoint
from llmgw_router.errors import ApiError, error_body, sse_error_event
from llmgw_router.hold import Holds
from llmgw_router.prefix import prefix_blocks, prompt_text
from llmgw_router.retry import RetryPolicy, Verdict, after_failure, retry_tiers
from llmgw_router.state import RouterState, now
from llmgw_router.tokens import PromptBlocks, PromptTokenizer
from llmgw_router.upstream import ConnectError, Pool, Response, UpstreamError

__all__ = ["Incoming", "ProxyApp", "Reply", "RequestContext", "RouterState"]

log = structlog.get_logger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

PROXIED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
PROFILE_HEADER = b"x-llmgw-profile"
# Request headers an engine gets from the client; the router's own API key stays here.
_FORWARD_REQUEST = frozenset({b"content-type", b"accept", b"x-request-id", b"traceparent"})
# Response headers that describe the hop, not the body: the ASGI server writes its own.
_HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"date", b"server", b"proxy-connection"}
)
_JSON = [(b"content-type", b"application/json")]


class _RequestHead(msgspec.Struct):
    """The few fields the router reads from a request body; the rest passes untouched."""

    model: str
    stream: bool = False
    user: str | None = None


class _RequestHeadWithPrompt(_RequestHead):
    """The same, plus the prompt's raw JSON text (not decoded) for prefix affinity."""

    messages: msgspec.Raw = msgspec.Raw()
    prompt: msgspec.Raw = msgspec.Raw()


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _WithUsage(msgspec.Struct):
    usage: _Usage | None = None


_decode_head = msgspec.json.Decoder(_RequestHead).decode
_decode_head_with_prompt = msgspec.json.Decoder(_RequestHeadWithPrompt).decode
_decode_usage = msgspec.json.Decoder(_WithUsage).decode


class _UpstreamFailure(Exception):
    """An attempt that failed before any byte went to the client: it may be retried."""

    def __init__(
        self,
        reason: str,
        detail: str,
        response: tuple[int, list[tuple[bytes, bytes]], bytes] | None = None,
    ) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        # For 5xx/429: the engine's own answer, passed on when no retry is left.
        self.response = response


Headers = dict[bytes, bytes]


class Reply(Protocol):
    """Where one request's answer goes: a head, then body pieces until the last.

    ``gone`` is set (and ``task`` cancelled) when the client goes away first.
    """

    gone: bool
    task: asyncio.Task[Any] | None

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...

    async def body(self, data: bytes, more: bool = False) -> None: ...


class Incoming(Reply, Protocol):
    """A request the router's own HTTP server has read whole (protocol.py)."""

    method: str
    path: str
    # Lower-case names; the first of repeated headers.
    headers: Headers
    content: bytes
    # The body went over max_body_bytes (and was not kept): answer 413.
    too_large: bool
    declared_length: int | None
    # Judged on the head, before any body byte was read (:meth:`ProxyApp.admit`): the
    # caller's key, or the error that answers the request (401, 404, 405).
    api_key: ApiKey | None
    refusal: ApiError | None


class _AsgiReply:
    """A :class:`Reply` as ASGI messages; notes when the last one goes out."""

    __slots__ = ("_send", "finishing", "gone", "task")

    def __init__(self, send: Send, task: asyncio.Task[Any] | None) -> None:
        self._send = send
        self.finishing = False
        self.gone = False
        self.task = task

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, data: bytes, more: bool = False) -> None:
        if not more:
            self.finishing = True
        await self._send({"type": "http.response.body", "body": data, "more_body": more})


class _ClientGone(Exception):
    pass


@dataclass(slots=True)
class RequestContext:
    """One proxied request, from its parsed head to its outcome."""

    path: str
    body: bytes
    # The request headers an engine gets.
    headers: list[tuple[bytes, bytes]]
    model: str
    candidates: tuple[Endpoint, ...]
    deadlines: Deadlines
    # On the router's one clock (state.now).
    started: float
    deadline: float
    # session_affinity's key: the affinity header, else the body's `user`.
    affinity_key: str | None = None
    # cache_aware's prompt prefix blocks, and with precise matching its token blocks.
    prefix: tuple[int, ...] = ()
    tokens: PromptBlocks | None = None
    tried: list[Endpoint] = field(default_factory=list)
    refused: set[str] = field(default_factory=set)
    # The balancer's last pick: why, and (cache_aware) the prefix blocks the endpoint is
    # predicted to prefill.
    pick_reason: str = ""
    pick_miss: int = 0
    retries: int = 0
    # The outcome, counted once when the request ends.
    status: int = 0
    endpoint: str = ""


class _Outcome:
    """What the one exit counts: set by whichever step answered."""

    __slots__ = ("ctx", "error_status")

    def __init__(self) -> None:
        self.ctx: RequestContext | None = None
        self.error_status = 0


def _asgi_headers(scope: Scope) -> Headers:
    headers: Headers = {}
    for key, value in scope["headers"]:
        headers.setdefault(bytes(key), bytes(value))
    return headers


async def _respond(
    reply: Reply, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await reply.start(status, [*_JSON, (b"content-length", b"%d" % len(body)), *(headers or [])])
    await reply.body(body)


def _too_large(limit: int, declared: int | None) -> ApiError:
    if declared is not None:
        message = f"request body of {declared} bytes is over the limit of {limit} bytes"
    else:
        message = f"request body is over the limit of {limit} bytes"
    return ApiError(413, message, code="request_too_large")


def _usage_from(tail: bytes, streamed: bool) -> _Usage | None:
    """The usage object of a JSON body, or of the last SSE event that carries one."""
    at = tail.rfind(b'"usage"')
    if at < 0:
        return None
    if not streamed:
        # Usage is mostly the body's last member: `{` + the body from it decodes alone,
        # without walking the choices. Anything else: the whole body.
        with contextlib.suppress(msgspec.DecodeError):
            return _decode_usage(b"{" + tail[at:]).usage
        with contextlib.suppress(msgspec.DecodeError):
            return _decode_usage(tail).usage
        return None
    # Only the event around the last mention is parsed, not the whole tail.
    start = tail.rfind(b"data: ", 0, at)
    end = tail.find(b"\n", at)
    if start < 0:
        return None
    with contextlib.suppress(msgspec.DecodeError):
        return _decode_usage(tail[start + 6 : end if end >= 0 else len(tail)]).usage
    return None


class ProxyApp:
    """The OpenAI routes: :meth:`serve_request` for the router's own server, ASGI otherwise."""

    def __init__(
        self, state: RouterState, pool: Pool | None = None, api_keys: tuple[ApiKey, ...] = ()
    ) -> None:
        self.state = state
        self.pool = pool
        self._keys = api_keys
        config = state.config
        self._affinity_header = config.affinity.header.lower().encode()
        self._deadlines_by_model: dict[str, Deadlines] = {}
        self._retry_policy = RetryPolicy(
            max_retries=config.retries.max_retries, retry_on_429=config.retries.retry_on_429
        )
        self._cache_aware = config.balancer == "cache_aware"
        self._block_bytes = config.cache_aware.block_bytes
        self._max_blocks = config.cache_aware.max_blocks
        # Precise matching: the tokenizers named by cache_aware.tokenizers (the config
        # check loaded each once already, so these load), shared with /v1/match.
        self._tokenizers = (
            {
                model: tokenizer
                for model in config.cache_aware.tokenizers
                if (tokenizer := state.tokenizer(model)) is not None
            }
            if self._cache_aware
            else {}
        )
        self.holds = Holds(state)

    async def serve_request(self, request: Incoming) -> None:
        """One request read whole by the router's own HTTP server, answered to the end."""
        outcome = _Outcome()
        try:
            if request.refusal is not None:
                raise request.refusal
            api_key = request.api_key
            if request.path == "/v1/models":
                await _respond(request, 200, self._models_body(api_key))
            else:
                self._check_draining()
                if request.too_large:
                    raise _too_large(self.state.config.max_body_bytes, request.declared_length)
                ctx = await self._context(request.path, request.headers, request.content, api_key)
                await self._run(ctx, request, outcome)
        except ApiError as err:
            outcome.error_status = err.status
            await _respond(request, err.status, err.body(), err.headers)
        except asyncio.CancelledError:
            # The client went away while the request waited (held, say): nothing to answer.
            if not request.gone or request.task is None:
                raise
            request.task.uncancel()
        finally:
            self._count(outcome)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            outcome = _Outcome()
            reply = _AsgiReply(send, asyncio.current_task())
            try:
                await self._route(scope, receive, reply, outcome)
            except ApiError as err:
                outcome.error_status = err.status
                await _respond(reply, err.status, err.body(), err.headers)
            finally:
                self._count(outcome)
        elif kind == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    def _count(self, outcome: _Outcome) -> None:
        """The one place request metrics are recorded."""
        metrics = self.state.metrics
        ctx = outcome.ctx
        if ctx is not None and ctx.status:
            metrics.child(metrics.requests, ctx.model, str(ctx.status), ctx.endpoint).inc()
            metrics.child(metrics.duration, ctx.model).observe(now() - ctx.started)
        elif outcome.error_status:
            # Labelled without model and endpoint: the model may be any string a client sent.
            metrics.child(metrics.requests, "", str(outcome.error_status), "").inc()

    def admit(self, method: str, path: str, headers: Headers) -> ApiKey | None:
        """Route and key checks on a request's head alone (the router's own server runs
        them before it reads the body): the caller's key (None: open access), or an
        ApiError."""
        return self._admit(method, path, headers)

    def _admit(self, method: str, path: str, headers: Headers) -> ApiKey | None:
        """Route and key checks: the caller's key (None: open access), or an ApiError."""
        if path in PROXIED_PATHS:
            if method != "POST":
                raise ApiError(
                    405, f"{method} is not allowed on {path}; use POST", code="method_not_allowed"
                )
        elif path == "/v1/models":
            if method != "GET":
                raise ApiError(
                    405, f"{method} is not allowed on {path}; use GET", code="method_not_allowed"
                )
        else:
            raise ApiError(404, f"no route {method} {path}", code="not_found")
        return self._authorize(headers)

    async def _route(
        self, scope: Scope, receive: Receive, reply: _AsgiReply, outcome: _Outcome
    ) -> None:
        path = scope["path"]
        headers = _asgi_headers(scope)
        api_key = self._admit(scope["method"], path, headers)
        if path == "/v1/models":
            await _respond(reply, 200, self._models_body(api_key))
            return
        self._check_draining()
        try:
            body = await self._read_body(headers, receive)
        except _ClientGone:
            return
        ctx = await self._context(path, headers, body, api_key)
        task = reply.task
        assert task is not None
        watcher = asyncio.create_task(self._watch_client(receive, reply))
        try:
            await self._run(ctx, reply, outcome)
        finally:
            watcher.cancel()

    def _authorize(self, headers: Headers) -> ApiKey | None:
        """The caller's key; None when the router has no keys (open access)."""
        if not self._keys:
            return None
        header = headers.get(b"authorization") or b""
        scheme, _, token = header.partition(b" ")
        token = token.strip()
        # Every key is compared, in constant time each, so timing says nothing about which.
        found: ApiKey | None = None
        for key in self._keys:
            if hmac.compare_digest(token, key.secret):
                found = key
        if scheme.lower() != b"bearer" or found is None:
            raise ApiError(
                401,
                "missing or invalid API key: send `Authorization: Bearer <key>`",
                "authentication_error",
                code="invalid_api_key",
            )
        return found

    def _models_body(self, api_key: ApiKey | None = None) -> bytes:
        """Models with a usable endpoint, and declared scale-to-zero models at zero."""
        at = now()
        endpoints = self.state.endpoints
        created = int(time.time())
        names = set(endpoints.models) | {m for m, zero in endpoints.declared.items() if zero}
        data = []
        for model in sorted(names):
            if api_key is not None and not api_key.allows(model):
                continue
            eps = endpoints.for_model(model) or ()
            if any(ep.usable(at) for ep in eps) or (not eps and endpoints.declared.get(model)):
                data.append(
                    {"id": model, "object": "model", "created": created, "owned_by": "llmgw"}
                )
        return msgspec.json.encode({"object": "list", "data": data})

    async def _read_body(self, headers: Headers, receive: Receive) -> bytes:
        limit = self.state.config.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise _too_large(limit, int(length))
        message = await receive()
        body: bytes = message.get("body", b"")
        if not message.get("more_body", False):
            if len(body) > limit:
                raise _too_large(limit, None)
            return body
        parts = bytearray(body)
        while message.get("more_body", False):
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            parts += message.get("body", b"")
            if len(parts) > limit:
                raise _too_large(limit, None)
        return bytes(parts)

    def _parse(self, body: bytes) -> _RequestHead:
        try:
            if self._cache_aware:
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

    def _no_endpoints(self, model: str) -> ApiError:
        """Why ``model`` has no endpoint at all: unknown, unavailable, or no snapshot yet."""
        state = self.state
        if not state.has_snapshot:
            control = state.control
            why = (
                f"control plane at {control.address} unreachable: {control.reason}"
                if control.reason and not control.connected
                else f"no endpoint snapshot yet from the control plane at {control.address}"
            )
            return ApiError(
                503,
                f"cannot route model `{model}`: {why}",
                "service_unavailable_error",
                param="model",
                code="control_plane_unavailable",
                headers=[(b"retry-after", b"1")],
            )
        if state.is_known(model):
            return ApiError(
                503,
                f"the model `{model}` has no endpoint right now",
                "service_unavailable_error",
                param="model",
                code="no_usable_endpoint",
                headers=[(b"retry-after", b"5")],
            )
        return ApiError(
            404, f"The model `{model}` does not exist", param="model", code="model_not_found"
        )

    async def _endpoints_of(self, model: str) -> tuple[Endpoint, ...]:
        endpoints = self.state.endpoints.for_model(model)
        if endpoints is not None:
            return endpoints
        if self.state.endpoints.declared.get(model) and self.state.config.hold.enabled:
            # Scale to zero: wait for the first endpoint (or 503 past the timeout/bound).
            return await self.holds.wait(model)
        raise self._no_endpoints(model)

    def _candidates(
        self, headers: Headers, model: str, endpoints: tuple[Endpoint, ...]
    ) -> tuple[Endpoint, ...]:
        pinned = headers.get(PROFILE_HEADER)
        if pinned is not None:
            profile = pinned.decode("latin-1")
            chosen = tuple(ep for ep in endpoints if ep.spec.profile == profile)
            if not chosen:
                raise ApiError(
                    404,
                    f"The model `{model}` has no profile `{profile}` (from the x-llmgw-profile header)",
                    param="x-llmgw-profile",
                    code="profile_not_found",
                )
            return chosen
        default = self.state.config.default_profile
        if default:
            at = now()
            preferred = tuple(
                ep for ep in endpoints if ep.spec.profile == default and ep.usable(at)
            )
            if preferred:
                return preferred
        return endpoints

    def _deadlines(self, model: str) -> Deadlines:
        found = self._deadlines_by_model.get(model)
        if found is None:
            found = self.state.config.deadlines_for(model)
            # Only models that have endpoints get here, so the cache stays small.
            self._deadlines_by_model[model] = found
        return found

    def _unavailable(self, model: str, candidates: tuple[Endpoint, ...]) -> ApiError:
        at = now()
        waits = [
            ep.outlier.ejected_until - at for ep in candidates if ep.outlier.ejected_until > at
        ]
        retry_after = max(1, math.ceil(min(waits))) if waits else 1
        return ApiError(
            503,
            f"no usable endpoint for model `{model}` right now",
            "service_unavailable_error",
            param="model",
            code="no_usable_endpoint",
            headers=[(b"retry-after", str(retry_after).encode())],
        )

    def _check_draining(self) -> None:
        if self.state.draining:
            raise ApiError(
                503,
                "the router is shutting down",
                "service_unavailable_error",
                code="shutting_down",
                headers=[(b"retry-after", b"1"), (b"connection", b"close")],
            )

    async def _context(
        self, path: str, headers: Headers, body: bytes, api_key: ApiKey | None
    ) -> RequestContext:
        """The request's routing facts from its body and headers; ApiError if it has none."""
        started = now()
        head = self._parse(body)
        model = head.model
        if api_key is not None and not api_key.allows(model):
            raise ApiError(
                403,
                f"API key {api_key.name!r} may not use model {model!r}",
                "permission_error",
                param="model",
                code="model_not_allowed",
            )
        endpoints = await self._endpoints_of(model)
        deadlines = self._deadlines(model)
        forward = []
        for name in _FORWARD_REQUEST:
            value = headers.get(name)
            if value is not None:
                forward.append((name, value))
        ctx = RequestContext(
            path=path,
            body=body,
            headers=forward,
            model=model,
            candidates=self._candidates(headers, model, endpoints),
            deadlines=deadlines,
            started=started,
            deadline=started + deadlines.total,
        )
        if self.state.config.balancer == "session_affinity":
            raw = headers.get(self._affinity_header)
            ctx.affinity_key = raw.decode("latin-1") if raw else head.user
        elif isinstance(head, _RequestHeadWithPrompt):
            prompt = head.messages or head.prompt
            if prompt:
                tokenizer = self._tokenizers.get(model)
                if tokenizer is not None:
                    ctx.tokens = await self._prompt_tokens(tokenizer, head)
                if ctx.tokens is not None:
                    # Blocks of block_bytes / 4 tokens (about as much prompt).
                    ctx.prefix = ctx.tokens.prefix(max(1, self._block_bytes // 4))
                else:
                    text = prompt_text(bytes(prompt), chat=bool(head.messages))
                    ctx.prefix = prefix_blocks(text, self._block_bytes, self._max_blocks)
        return ctx

    async def _prompt_tokens(
        self, tokenizer: PromptTokenizer, head: _RequestHeadWithPrompt
    ) -> PromptBlocks | None:
        """The prompt as the engine tokenizes it; None when not known here. Prefixes
        tokenized before come from the cache; a long new part is encoded off the loop."""
        try:
            if head.messages:
                tokens = await tokenizer.chat_async(msgspec.json.decode(head.messages))
            else:
                tokens = await tokenizer.completion_async(msgspec.json.decode(head.prompt))
        except (msgspec.DecodeError, RecursionError):
            return None
        if not tokens:
            return None
        self.state.metrics.prompts_tokenized.inc()
        return PromptBlocks(tokens, self._max_blocks)

    async def _run(self, ctx: RequestContext, reply: Reply, outcome: _Outcome) -> None:
        state = self.state
        state.in_flight += 1
        outcome.ctx = ctx
        try:
            await self._serve(ctx, reply)
        except asyncio.CancelledError:
            if not reply.gone or reply.task is None:
                raise
            # The client went away: the upstream request is closed by now; nothing to answer.
            reply.task.uncancel()
            state.metrics.child(state.metrics.client_disconnects, ctx.model).inc()
            log.info("client disconnected", model=ctx.model, after=round(now() - ctx.started, 3))
        finally:
            state.in_flight -= 1

    @staticmethod
    async def _watch_client(receive: Receive, reply: _AsgiReply) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                # Some servers (hypercorn) also say "disconnect" once the response is
                # complete; only one that comes before the last byte cancels anything.
                if not reply.finishing and reply.task is not None:
                    reply.gone = True
                    reply.task.cancel()
                return

    def _pick(self, ctx: RequestContext) -> Endpoint | None:
        state = self.state
        balancer = state.balancer
        at = now()
        tokens = ctx.tokens
        cached = (
            (lambda ep: tokens.cached(ep.token_blocks, ep.token_block_size))
            if tokens is not None
            else None
        )
        if not ctx.tried:
            tiers = [list(ctx.candidates)]
        else:
            current = state.endpoints.for_model(ctx.model) or ()
            tiers = retry_tiers(ctx.candidates, current, [t.id for t in ctx.tried], ctx.refused)
        for tier in tiers:
            if not tier:
                continue
            usable = state.usable_among(tier, at)
            choice = balancer.choose(tier, usable, ctx.affinity_key, ctx.prefix, cached)
            ep = choice.endpoint
            if ep is not None:
                # Charged at pick time: a burst between two load reports spreads.
                ep.sent(at)
                reason = choice.reason
                if getattr(usable, "__name__", "") == "panic":
                    reason = "panic_" + reason
                ctx.pick_reason, ctx.pick_miss = reason, choice.miss
                state.metrics.child(state.metrics.picks, ctx.model, reason).inc()
                log.debug("picked", model=ctx.model, endpoint=ep.id, reason=reason)
                return ep
        return None

    async def _serve(self, ctx: RequestContext, send: Reply) -> None:
        state = self.state
        metrics = state.metrics
        state.budget.on_request(ctx.started)
        last_failure: _UpstreamFailure | None = None
        while True:
            ep = self._pick(ctx)
            if ep is None:
                if last_failure is not None and ctx.tried:
                    await self._give_up(ctx, send, ctx.tried[-1], last_failure)
                    return
                raise self._unavailable(ctx.model, ctx.candidates)
            ctx.tried.append(ep)
            try:
                await self._attempt(ctx, send, ep)
                return
            except _UpstreamFailure as failure:
                last_failure = failure
                if failure.reason == "connect":
                    ctx.refused.add(ep.id)
                state.record_failure(ep, failure.reason)
                log.info(
                    "upstream attempt failed",
                    endpoint=ep.id,
                    model=ctx.model,
                    reason=failure.reason,
                    detail=failure.detail,
                    pick=ctx.pick_reason,
                )
            verdict = after_failure(
                self._retry_policy,
                retries=ctx.retries,
                reason=last_failure.reason,
                now=now(),
                deadline=ctx.deadline,
                spend=state.budget.try_spend,
            )
            if verdict is not Verdict.RETRY:
                if verdict is Verdict.BUDGET:
                    metrics.child(metrics.retries_denied, ctx.model).inc()
                await self._give_up(ctx, send, ep, last_failure)
                return
            ctx.retries += 1
            metrics.child(metrics.retries, ctx.model).inc()

    async def _give_up(
        self, ctx: RequestContext, send: Reply, ep: Endpoint, failure: _UpstreamFailure
    ) -> None:
        if failure.response is not None:
            status, headers, payload = failure.response
            await send.start(status, headers)
            await send.body(payload)
        else:
            status = 504 if failure.reason.startswith("timeout") else 502
            await _respond(
                send,
                status,
                error_body(
                    f"upstream failed for model `{ctx.model}`: {failure.detail}",
                    "upstream_error",
                    None,
                    failure.reason,
                ),
            )
        ctx.status, ctx.endpoint = status, ep.id

    async def _attempt(self, ctx: RequestContext, send: Reply, ep: Endpoint) -> None:
        state = self.state
        pool = self.pool
        assert pool is not None
        deadlines = ctx.deadlines
        ep.outstanding += 1
        ep.awaiting_first += 1
        awaiting = True
        miss = ctx.pick_miss
        work = ep.begin_prefill(miss)
        sent_at = now()
        response: Response | None = None
        clean = False
        try:
            # On the event loop's clock, which the upstream client's timers use.
            wait = max(0.0, min(deadlines.first_byte, ctx.deadline - now()))
            first_byte_by = pool.loop.time() + wait
            try:
                response = await pool.post(
                    ep.url,
                    ctx.path,
                    ctx.body,
                    ctx.headers,
                    connect_timeout=deadlines.connect,
                    deadline=first_byte_by,
                    api_key=ep.spec.api_key,
                )
                status = response.status
                if status >= 500 or status == 429:
                    payload = await response.read(first_byte_by)
                    raise _UpstreamFailure(
                        "status_429" if status == 429 else "status_5xx",
                        f"{ep.id} answered {status}",
                        (status, self._response_headers(response), payload),
                    )
                first = await response.read_chunk(first_byte_by)
                # Past the queue and the prefill: the engine is generating for it.
                ep.awaiting_first -= 1
                awaiting = False
                ep.end_prefill(miss, work, now() - sent_at)
            except TimeoutError:
                raise _UpstreamFailure(
                    "timeout_first_byte",
                    f"{ep.id}: no response within {deadlines.first_byte:g}s",
                ) from None
            except ConnectError as err:
                raise _UpstreamFailure("connect", f"{ep.id}: {err}") from None
            except UpstreamError as err:
                raise _UpstreamFailure("reset", f"{ep.id}: {err}") from None
            except _UpstreamFailure:
                raise
            except Exception as err:
                # Anything else on the way to the engine is its failure, never a 500
                # (issue 24.7): before a response a connect failure, after one a reset.
                raise _UpstreamFailure(
                    "connect" if response is None else "reset",
                    f"{ep.id}: {type(err).__name__}: {err}",
                ) from None
            if status < 500:
                state.record_success(ep)
            clean = await self._relay(ctx, send, ep, response, first)
        finally:
            ep.outstanding -= 1
            if awaiting:
                ep.awaiting_first -= 1
                ep.end_prefill(miss, work, None)
            ep.finished(now())
            if response is not None:
                # An unfinished response must not go back to the pool: closing it is
                # also what tells the engine to stop generating.
                if clean:
                    response.release()
                else:
                    response.close()

    @staticmethod
    def _response_headers(response: Response) -> list[tuple[bytes, bytes]]:
        return [(k, v) for k, v in response.headers if k not in _HOP_BY_HOP]

    async def _relay(
        self, ctx: RequestContext, send: Reply, ep: Endpoint, response: Response, first: bytes
    ) -> bool:
        """Pass the response on chunk by chunk; True when it ended cleanly."""
        metrics = self.state.metrics
        model = ctx.model
        deadlines = ctx.deadlines
        assert self.pool is not None
        loop = self.pool.loop
        status = response.status
        content_type = next((v for k, v in response.headers if k == b"content-type"), b"")
        streamed = content_type.startswith(b"text/event-stream")
        ttft = now() - ctx.started
        metrics.child(metrics.ttft, model).observe(ttft)
        await send.start(status, self._response_headers(response))
        # What usage is read from: the whole (small) JSON body, or a stream's last chunks.
        previous = b""
        last = first
        collected = bytearray(first) if not streamed else None
        clean = ended = False
        failure = ""
        # The usage is counted even when the client leaves first: a client that closes on
        # `data: [DONE]` can be gone before the upstream's end is read, and the engine did
        # the work either way.
        try:
            if first and response.at_eof:
                # All of it came in one read (small JSON answers, fast short streams): one write.
                clean = ended = True
                await send.body(first)
            elif first:
                gap = metrics.child(metrics.gap, model) if streamed else None
                await send.body(first, True)
                # The chunk loop runs on the event loop's clock (what the client's timers use),
                # with the request's deadline carried over from the router's clock once.
                last_at = loop.time()
                total_at = last_at + (ctx.deadline - now())
                idle = deadlines.idle
                try:
                    while True:
                        chunk = await response.read_chunk(min(last_at + idle, total_at))
                        if not chunk:
                            clean = True
                            break
                        at = loop.time()
                        if gap is not None:
                            gap.observe(at - last_at)
                        last_at = at
                        previous, last = last, chunk
                        if collected is not None and len(collected) < 1 << 20:
                            collected += chunk
                        await send.body(chunk, True)
                except TimeoutError:
                    failure = (
                        f"no data from {ep.id} for {idle:g}s"
                        if loop.time() < total_at
                        else f"request exceeded its total deadline of {deadlines.total:g}s"
                    )
                    self.state.record_failure(ep, "timeout_idle")
                except UpstreamError as err:
                    failure = f"{ep.id} broke off the response: {err}"
                    self.state.record_failure(ep, "reset")
            else:
                clean = True
            if failure:
                log.warning(
                    "stream failed after first byte", endpoint=ep.id, model=model, error=failure
                )
                if streamed:
                    await send.body(sse_error_event(failure, "upstream_error"))
                else:
                    # Nothing honest can be appended to a half-sent JSON body: end it short.
                    await send.body(b"")
            elif not ended:
                await send.body(b"")
        finally:
            usage = _usage_from(
                bytes(collected) if collected is not None else previous + last, streamed
            )
            if usage is not None:
                metrics.child(metrics.tokens, model, "prompt").inc(usage.prompt_tokens)
                metrics.child(metrics.tokens, model, "completion").inc(usage.completion_tokens)
        ctx.status, ctx.endpoint = status, ep.id
        return clean
