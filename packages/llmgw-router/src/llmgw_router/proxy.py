"""The OpenAI-facing proxy: a plain ASGI app on the request path.

Plain ASGI rather than a framework's Request/Response objects, because every
microsecond here is added to every request. One request:

1. read the body (bounded), decode only `model`, `stream` and `user` from it;
2. pick an endpoint of the model (profile pin or default profile first);
3. send the body unchanged; wait for the response head and its first body chunk
   within `first_byte`. A failure up to here goes to another endpoint, bounded by
   the retry count and the retry budget;
4. pass every further chunk on as it arrives; after the first byte a failure ends
   an SSE stream with an error event and `[DONE]`.

A task watches the client side: a disconnect cancels the request, which closes the
upstream connection and so ends the engine's work at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import math
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec
import structlog

from llmgw_router.balancers import Balancer, make_balancer
from llmgw_router.budget import RetryBudget
from llmgw_router.config import ApiKey, Deadlines, RouterConfig
from llmgw_router.endpoints import Endpoint, EndpointSet
from llmgw_router.errors import ApiError, error_body, sse_error_event
from llmgw_router.metrics import Metrics
from llmgw_router.outlier import OutlierPolicy, record_failure, record_success
from llmgw_router.upstream import ConnectError, Pool, Response, UpstreamError

__all__ = ["ProxyApp", "RouterState"]

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


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _WithUsage(msgspec.Struct):
    usage: _Usage | None = None


_decode_head = msgspec.json.Decoder(_RequestHead).decode
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


class _Exchange:
    """The client side of one request: notes when the last response message goes out."""

    __slots__ = ("_send", "finishing")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.finishing = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finishing = True
        await self._send(message)


class _ClientGone(Exception):
    pass


class RouterState:
    """What the proxy and the admin app share: the endpoint set and the live policy."""

    def __init__(self, config: RouterConfig, endpoints: EndpointSet, metrics: Metrics) -> None:
        self.config = config
        # Swapped whole by one assignment when a new snapshot arrives.
        self.endpoints = endpoints
        self.metrics = metrics
        self.balancer: Balancer[Endpoint] = make_balancer(config.balancer)
        self.budget = RetryBudget(
            config.retries.budget_ratio, config.retries.budget_min_per_second, now=time.monotonic()
        )
        self.outlier_policy = OutlierPolicy(
            consecutive_failures=config.ejection.consecutive_failures,
            base_time=config.ejection.base_time,
            max_time=config.ejection.max_time,
        )
        self.draining = False
        self.in_flight = 0
        self.has_snapshot = len(endpoints) > 0

    def swap(self, endpoints: EndpointSet) -> None:
        self.endpoints = endpoints
        self.has_snapshot = True
        self.metrics.snapshot_version.set(endpoints.version)

    def record_failure(self, ep: Endpoint, reason: str) -> None:
        if reason == "status_429":
            # Busy is not broken: a 429 is retried elsewhere but never ejects.
            self.metrics.child(self.metrics.upstream_errors, ep.id, reason).inc()
            return
        now = time.monotonic()
        before = ep.outlier.ejected_until
        ep.outlier = record_failure(ep.outlier, now, self.outlier_policy)
        self.metrics.child(self.metrics.upstream_errors, ep.id, reason).inc()
        if ep.outlier.ejected_until > now >= before:
            self.metrics.child(self.metrics.ejections, ep.id).inc()
            log.warning(
                "endpoint ejected",
                endpoint=ep.id,
                seconds=round(ep.outlier.ejected_until - now, 3),
                ejections=ep.outlier.ejections,
                reason=reason,
            )

    def record_success(self, ep: Endpoint) -> None:
        outlier = ep.outlier
        if outlier.consecutive_failures or outlier.ejections:
            ep.outlier = record_success(outlier, time.monotonic(), self.outlier_policy)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


async def _respond(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*_JSON, (b"content-length", str(len(body)).encode()), *(headers or [])],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _usable_at(now: float) -> Callable[[Endpoint], bool]:
    def usable(ep: Endpoint) -> bool:
        return ep.usable(now)

    return usable


def _usage_from(tail: bytes, streamed: bool) -> _Usage | None:
    """The usage object of a JSON body, or of the last SSE event that carries one."""
    at = tail.rfind(b'"usage"')
    if at < 0:
        return None
    if not streamed:
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
    """ASGI app for the OpenAI routes."""

    def __init__(
        self, state: RouterState, pool: Pool | None = None, api_keys: tuple[ApiKey, ...] = ()
    ) -> None:
        self.state = state
        self.pool = pool
        self._keys = api_keys
        self._affinity_header = state.config.affinity.header.lower().encode()
        self._deadlines_by_model: dict[str, Deadlines] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            try:
                await self._route(scope, receive, send)
            except ApiError as err:
                # Labelled without model and endpoint: the model may be any string a client sent.
                self.state.metrics.child(self.state.metrics.requests, "", str(err.status), "").inc()
                await _respond(send, err.status, err.body(), err.headers)
        elif kind == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        method = scope["method"]
        if path in PROXIED_PATHS:
            if method != "POST":
                raise ApiError(
                    405, f"{method} is not allowed on {path}; use POST", code="method_not_allowed"
                )
            key = self._authorize(scope)
            await self._proxy(scope, receive, send, key)
        elif path == "/v1/models":
            if method != "GET":
                raise ApiError(
                    405, f"{method} is not allowed on {path}; use GET", code="method_not_allowed"
                )
            key = self._authorize(scope)
            await _respond(send, 200, self._models_body(key))
        else:
            raise ApiError(404, f"no route {method} {path}", code="not_found")

    def _authorize(self, scope: Scope) -> ApiKey | None:
        """The caller's key; None when the router has no keys (open access)."""
        if not self._keys:
            return None
        header = _header(scope, b"authorization") or b""
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

    def _models_body(self, key: ApiKey | None = None) -> bytes:
        now = time.monotonic()
        endpoints = self.state.endpoints
        created = int(time.time())
        data = []
        for model in endpoints.models:
            if key is not None and not key.allows(model):
                continue
            eps = endpoints.for_model(model) or ()
            if any(ep.usable(now) for ep in eps):
                data.append(
                    {"id": model, "object": "model", "created": created, "owned_by": "llmgw"}
                )
        return msgspec.json.encode({"object": "list", "data": data})

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.state.config.max_body_bytes
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise ApiError(
                413,
                f"request body of {int(length)} bytes is over the limit of {limit} bytes",
                code="request_too_large",
            )
        message = await receive()
        body: bytes = message.get("body", b"")
        if not message.get("more_body", False):
            if len(body) > limit:
                raise ApiError(
                    413,
                    f"request body is over the limit of {limit} bytes",
                    code="request_too_large",
                )
            return body
        parts = bytearray(body)
        while message.get("more_body", False):
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            parts += message.get("body", b"")
            if len(parts) > limit:
                raise ApiError(
                    413,
                    f"request body is over the limit of {limit} bytes",
                    code="request_too_large",
                )
        return bytes(parts)

    @staticmethod
    def _parse(body: bytes) -> _RequestHead:
        try:
            return _decode_head(body)
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

    def _candidates(self, scope: Scope, model: str) -> tuple[Endpoint, ...]:
        endpoints = self.state.endpoints.for_model(model)
        if endpoints is None:
            raise ApiError(
                404, f"The model `{model}` does not exist", param="model", code="model_not_found"
            )
        pinned = _header(scope, PROFILE_HEADER)
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
            now = time.monotonic()
            preferred = tuple(
                ep for ep in endpoints if ep.spec.profile == default and ep.usable(now)
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
        now = time.monotonic()
        waits = [
            ep.outlier.ejected_until - now for ep in candidates if ep.outlier.ejected_until > now
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

    async def _proxy(
        self, scope: Scope, receive: Receive, send: Send, api_key: ApiKey | None = None
    ) -> None:
        state = self.state
        started = time.monotonic()
        if state.draining:
            raise ApiError(
                503,
                "the router is shutting down",
                "service_unavailable_error",
                code="shutting_down",
                headers=[(b"retry-after", b"1"), (b"connection", b"close")],
            )
        try:
            body = await self._read_body(scope, receive)
        except _ClientGone:
            return
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
        candidates = self._candidates(scope, model)
        key: str | None = None
        if state.config.balancer == "session_affinity":
            raw = _header(scope, self._affinity_header)
            key = raw.decode("latin-1") if raw else head.user

        task = asyncio.current_task()
        assert task is not None
        gone = asyncio.Event()
        exchange = _Exchange(send)
        watcher = asyncio.create_task(self._watch_client(receive, task, gone, exchange))
        state.in_flight += 1
        try:
            await self._serve(scope, exchange.send, body, model, candidates, key, started)
        except asyncio.CancelledError:
            if not gone.is_set():
                raise
            # The client went away: the upstream request is closed by now; nothing to answer.
            task.uncancel()
            state.metrics.child(state.metrics.client_disconnects, model).inc()
            log.info("client disconnected", model=model, after=round(time.monotonic() - started, 3))
        finally:
            state.in_flight -= 1
            watcher.cancel()

    @staticmethod
    async def _watch_client(
        receive: Receive, handler: asyncio.Task[Any], gone: asyncio.Event, exchange: _Exchange
    ) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                # Some servers (hypercorn) also say "disconnect" once the response is
                # complete; only one that comes before the last byte cancels anything.
                if not exchange.finishing:
                    gone.set()
                    handler.cancel()
                return

    async def _serve(
        self,
        scope: Scope,
        send: Send,
        body: bytes,
        model: str,
        candidates: tuple[Endpoint, ...],
        key: str | None,
        started: float,
    ) -> None:
        state = self.state
        metrics = state.metrics
        deadlines = self._deadlines(model)
        total_deadline = started + deadlines.total
        headers = [(k, v) for k, v in scope["headers"] if k in _FORWARD_REQUEST]
        state.budget.on_request(started)
        path: str = scope["path"]
        tried: list[Endpoint] = []
        refused: set[str] = set()
        last_failure: _UpstreamFailure | None = None
        retries = 0
        now = started
        while True:
            usable = _usable_at(now)
            if tried:
                # A retry: from the current set (a snapshot may have come), in the same
                # profiles as the first choice when any is left there; an endpoint not
                # tried yet first.
                current = state.endpoints.for_model(model) or ()
                profiles = {ep.spec.profile for ep in candidates}
                pool = [ep for ep in current if ep.spec.profile in profiles] or list(current)
                tried_ids = {t.id for t in tried}
                ep = state.balancer.pick([e for e in pool if e.id not in tried_ids], usable, key)
                if ep is None:
                    # All tried: again any but the last, and none that refused a connection.
                    skip = {tried[-1].id, *refused}
                    ep = state.balancer.pick([e for e in pool if e.id not in skip], usable, key)
            else:
                ep = state.balancer.pick(candidates, usable, key)
            if ep is None:
                if last_failure is not None and tried:
                    await self._give_up(send, model, tried[-1], last_failure, started)
                    return
                raise self._unavailable(model, candidates)
            tried.append(ep)
            try:
                await self._attempt(
                    send,
                    ep,
                    path,
                    body,
                    headers,
                    model,
                    deadlines,
                    started,
                    total_deadline,
                )
                return
            except _UpstreamFailure as failure:
                last_failure = failure
                if failure.reason == "connect":
                    refused.add(ep.id)
                state.record_failure(ep, failure.reason)
                log.info(
                    "upstream attempt failed",
                    endpoint=ep.id,
                    model=model,
                    reason=failure.reason,
                    detail=failure.detail,
                )
            now = time.monotonic()
            if retries >= state.config.retries.max_retries or now >= total_deadline:
                await self._give_up(send, model, ep, last_failure, started)
                return
            if last_failure.reason == "status_429" and not state.config.retries.retry_on_429:
                await self._give_up(send, model, ep, last_failure, started)
                return
            if not state.budget.try_spend(now):
                metrics.child(metrics.retries_denied, model).inc()
                await self._give_up(send, model, ep, last_failure, started)
                return
            retries += 1
            metrics.child(metrics.retries, model).inc()

    async def _give_up(
        self, send: Send, model: str, ep: Endpoint, failure: _UpstreamFailure | None, started: float
    ) -> None:
        metrics = self.state.metrics
        if failure is not None and failure.response is not None:
            status, headers, payload = failure.response
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": payload})
        else:
            detail = failure.detail if failure is not None else "no endpoint answered"
            status = 504 if failure is not None and failure.reason.startswith("timeout") else 502
            await _respond(
                send,
                status,
                error_body(
                    f"upstream failed for model `{model}`: {detail}",
                    "upstream_error",
                    None,
                    failure.reason if failure else None,
                ),
            )
        metrics.child(metrics.requests, model, str(status), ep.id).inc()
        metrics.child(metrics.duration, model).observe(time.monotonic() - started)

    async def _attempt(
        self,
        send: Send,
        ep: Endpoint,
        path: str,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        model: str,
        deadlines: Deadlines,
        started: float,
        total_deadline: float,
    ) -> None:
        state = self.state
        pool = self.pool
        assert pool is not None
        loop = asyncio.get_running_loop()
        ep.outstanding += 1
        response: Response | None = None
        clean = False
        try:
            now = loop.time()
            first_deadline = now + min(deadlines.first_byte, total_deadline - time.monotonic())
            try:
                async with asyncio.timeout_at(first_deadline):
                    response = await pool.post(
                        ep.url, path, body, headers, connect_timeout=deadlines.connect
                    )
                    status = response.status
                    if status >= 500 or status == 429:
                        payload = await response.read()
                        raise _UpstreamFailure(
                            "status_429" if status == 429 else "status_5xx",
                            f"{ep.id} answered {status}",
                            (status, self._response_headers(response), payload),
                        )
                    first = await response.read_chunk()
            except TimeoutError:
                raise _UpstreamFailure(
                    "timeout_first_byte",
                    f"{ep.id}: no response within {deadlines.first_byte:g}s",
                ) from None
            except ConnectError as err:
                raise _UpstreamFailure("connect", f"{ep.id}: {err}") from None
            except UpstreamError as err:
                raise _UpstreamFailure("reset", f"{ep.id}: {err}") from None
            if status < 500:
                state.record_success(ep)
            clean = await self._relay(
                send, ep, response, first, model, deadlines, started, total_deadline
            )
        finally:
            ep.outstanding -= 1
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
        self,
        send: Send,
        ep: Endpoint,
        response: Response,
        first: bytes,
        model: str,
        deadlines: Deadlines,
        started: float,
        total_deadline: float,
    ) -> bool:
        """Pass the response on chunk by chunk; True when it ended cleanly."""
        metrics = self.state.metrics
        loop = asyncio.get_running_loop()
        status = response.status
        content_type = next((v for k, v in response.headers if k == b"content-type"), b"")
        streamed = content_type.startswith(b"text/event-stream")
        ttft = time.monotonic() - started
        metrics.child(metrics.ttft, model).observe(ttft)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": self._response_headers(response),
            }
        )
        # What usage is read from: the whole (small) JSON body, or a stream's last chunks.
        previous = b""
        last = first
        collected = bytearray(first) if not streamed else None
        clean = ended = False
        failure = ""
        if first and response.at_eof:
            # All of it came in one read (small JSON answers, fast short streams): one write.
            clean = ended = True
            await send({"type": "http.response.body", "body": first})
        elif first:
            gap = metrics.child(metrics.gap, model) if streamed else None
            await send({"type": "http.response.body", "body": first, "more_body": True})
            last_at = loop.time()
            try:
                async with asyncio.timeout(None) as deadline:
                    total_at = last_at + (total_deadline - time.monotonic())
                    idle = deadlines.idle
                    while True:
                        deadline.reschedule(min(last_at + idle, total_at))
                        chunk = await response.read_chunk()
                        if not chunk:
                            clean = True
                            break
                        now = loop.time()
                        if gap is not None:
                            gap.observe(now - last_at)
                        last_at = now
                        previous, last = last, chunk
                        if collected is not None and len(collected) < 1 << 20:
                            collected += chunk
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
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
                await send(
                    {
                        "type": "http.response.body",
                        "body": sse_error_event(failure, "upstream_error"),
                    }
                )
            else:
                # Nothing honest can be appended to a half-sent JSON body: end it short.
                await send({"type": "http.response.body", "body": b""})
        elif not ended:
            await send({"type": "http.response.body", "body": b""})
        usage = _usage_from(
            bytes(collected) if collected is not None else previous + last, streamed
        )
        if usage is not None:
            metrics.child(metrics.tokens, model, "prompt").inc(usage.prompt_tokens)
            metrics.child(metrics.tokens, model, "completion").inc(usage.completion_tokens)
        metrics.child(metrics.requests, model, str(status), ep.id).inc()
        metrics.child(metrics.duration, model).observe(time.monotonic() - started)
        return clean
