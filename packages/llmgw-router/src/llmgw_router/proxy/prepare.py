"""The parse stage of the routes in routes.py: the model, the body and path the engine
gets, and the replica a stored response pins the request to."""

from __future__ import annotations

from dataclasses import dataclass

from llmgw_router.endpoints import Endpoint
from llmgw_router.errors import ApiError
from llmgw_router.proxy import routes
from llmgw_router.proxy.context import Headers, RequestContext
from llmgw_router.proxy.parse import RequestHead, parse_head
from llmgw_router.state import RouterState
from llmgw_router.upstream import Response

__all__ = ["Prepared", "pin", "prepare"]


@dataclass(slots=True)
class Prepared:
    """One request of a route in routes.py, ready for the route stage."""

    head: RequestHead
    path: str
    body: bytes
    method: str = "POST"
    # The endpoint that stored the response the request names (it must go there).
    pinned: str = ""
    # The client's name for that response, for the error when the endpoint is gone.
    response_id: str = ""
    # Response ids in the answer are rewritten to name the endpoint (/v1/responses).
    rewrite_ids: bool = False
    # The route an endpoint must serve (its engine's paths, Endpoint.routes).
    route: str = ""


def prepare(
    method: str, path: str, headers: Headers, body: bytes, state: RouterState, with_prompt: bool
) -> Prepared | None:
    """None: not a route of routes.py (chat, completions, embeddings)."""
    if path in routes.JSON_ROUTES:
        head = parse_head(body, with_prompt)
        if path != routes.RESPONSES_PATH:
            return Prepared(head, path, body, route=path)
        previous = routes.previous_response(body)
        if previous is None:
            return Prepared(head, path, body, rewrite_ids=True, route=path)
        endpoint_id, _, new_body = previous
        return Prepared(
            head,
            path,
            new_body,
            pinned=endpoint_id,
            response_id=_previous_id(body),
            rewrite_ids=True,
            route=path,
        )
    if path in routes.FORM_ROUTES:
        model = routes.form_field(body, headers.get(b"content-type", b""), "model")
        if not model:
            raise ApiError(
                400,
                f"the form sent to {path} has no `model` field naming the model",
                param="model",
                code="invalid_request",
            )
        return Prepared(RequestHead(model=model), path, body, route=path)
    call = routes.stored_call(path)
    if call is None:
        return None
    decoded = routes.decode_id(call.response_id)
    if decoded is None:
        raise routes.unknown_response(call.response_id)
    engine_id, endpoint_id = decoded
    ep = state.endpoints.by_id.get(endpoint_id)
    if ep is None or not ep.spec.models:
        raise _gone(call.response_id, endpoint_id)
    return Prepared(
        RequestHead(model=ep.spec.models[0]),
        f"{routes.RESPONSES_PATH}/{engine_id}{call.action}{call.query}",
        body,
        method=method,
        pinned=endpoint_id,
        response_id=call.response_id,
        rewrite_ids=True,
        route=routes.RESPONSES_PATH,
    )


def _previous_id(body: bytes) -> str:
    import msgspec

    value = msgspec.json.decode(body).get("previous_response_id")
    return value if isinstance(value, str) else ""


def _gone(response_id: str, endpoint_id: str) -> ApiError:
    return ApiError(
        404,
        f"No response with id `{response_id}`: the replica that stored it ({endpoint_id})"
        " is no longer in the fleet",
        param="response_id",
        code="response_not_found",
    )


def pin(ctx: RequestContext, prepared: Prepared, state: RouterState) -> None:
    """Send the request only to the endpoint that stored its response; rewrite ids."""
    ctx.method = prepared.method
    if prepared.route:
        ctx.candidates = serving(ctx.candidates, prepared.route, ctx.model)
    if prepared.pinned:
        found: Endpoint | None = None
        for ep in state.endpoints.for_model(ctx.model) or ():
            if ep.id == prepared.pinned:
                found = ep
        if found is None:
            raise _gone(prepared.response_id, prepared.pinned)
        ctx.candidates = (found,)
    if prepared.rewrite_ids:
        ctx.wrap = IdRewritten.wrap


def serving(candidates: tuple[Endpoint, ...], route: str, model: str) -> tuple[Endpoint, ...]:
    """The candidates whose engine serves ``route`` (one that did not say: any route);
    none: a 404 naming the route and the model."""
    found = tuple(ep for ep in candidates if not ep.spec.routes or route in ep.spec.routes)
    if not found:
        raise ApiError(
            404,
            f"No replica of the model `{model}` serves {route}",
            param="model",
            code="route_not_served",
        )
    return found


class IdRewritten(Response):
    """An engine's response whose response ids are rewritten (routes.IdRewriter) on the
    way to the client: a JSON body whole (its length recomputed), a stream event by
    event."""

    __slots__ = ("_eof", "_inner", "_rewriter", "_streamed")

    @classmethod
    def wrap(cls, response: Response, ep: Endpoint) -> Response:
        return cls(response, ep.id)

    def __init__(self, inner: Response, endpoint_id: str) -> None:
        self._inner = inner
        self._rewriter = routes.IdRewriter(endpoint_id)
        self._eof = False
        self.status = inner.status
        ctype = b""
        for name, value in inner.headers:
            if name == b"content-type":
                ctype = value
        self._streamed = ctype.startswith(b"text/event-stream")
        self.headers = (
            inner.headers
            if self._streamed
            else [(k, v) for k, v in inner.headers if k != b"content-length"]
        )

    @property
    def at_eof(self) -> bool:
        return self._eof

    async def read_chunk(self, deadline: float | None = None) -> bytes:
        if self._eof:
            return b""
        inner = self._inner
        rewriter = self._rewriter
        if not self._streamed:
            self._eof = True
            body = rewriter.whole(await inner.read(deadline))
            self.headers.append((b"content-length", b"%d" % len(body)))
            return body
        while True:
            chunk = await inner.read_chunk(deadline)
            if not chunk:
                self._eof = True
                return rewriter.flush()
            out = rewriter.feed(chunk)
            if out:
                return out

    def release(self) -> None:
        self._inner.release()

    def close(self) -> None:
        self._inner.close()
