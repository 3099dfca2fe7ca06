"""Stage 3, route: which endpoints may serve the request, and within what time.

The model from the parsed head, checked against the caller's key (403); its endpoints
(a declared scale-to-zero model without one is held until one appears, hold.py;
none at all is a 404 or 503 that says why); the profile pin (`x-llmgw-profile`) or
the default profile; the model's deadlines; the headers an engine gets. Its result is
the request's :class:`RequestContext`.
"""

from __future__ import annotations

from llmgw_router.config import ApiKey, Deadlines
from llmgw_router.endpoints import Endpoint
from llmgw_router.errors import ApiError
from llmgw_router.hold import Holds
from llmgw_router.lora import holders
from llmgw_router.proxy.context import Headers, RequestContext
from llmgw_router.state import RouterState, now

__all__ = ["PROFILE_HEADER", "Router"]

PROFILE_HEADER = b"x-llmgw-profile"
# Request headers an engine gets from the client; the router's own API key stays here.
_FORWARD_REQUEST = frozenset({b"content-type", b"accept", b"x-request-id", b"traceparent"})


class Router:
    """The model's candidates and deadlines for one request."""

    __slots__ = ("_deadlines_by_model", "holds", "state")

    def __init__(self, state: RouterState) -> None:
        self.state = state
        self.holds = Holds(state)
        self.holds.adapter_holders = self.adapter_holders
        self._deadlines_by_model: dict[str, Deadlines] = {}

    def context(
        self,
        path: str,
        headers: Headers,
        body: bytes,
        model: str,
        api_key: ApiKey | None,
        started: float,
    ) -> RequestContext | None:
        """The request's routing facts: candidates, deadlines, the headers an engine gets.
        None when the request is to wait for an endpoint (a declared scale-to-zero model
        at zero: :meth:`wait_for`, then :meth:`context_over`); ApiError when the model may
        not or cannot be served."""
        if api_key is not None and not api_key.allows(model):
            raise ApiError(
                403,
                f"API key {api_key.name!r} may not use model {model!r}",
                "permission_error",
                param="model",
                code="model_not_allowed",
            )
        state = self.state
        endpoints = state.endpoints.for_model(model)
        if endpoints is None and model in state.endpoints.adapters:
            # A LoRA adapter: the replicas of its base model that hold it (llmgw_router.lora).
            state.lora.count(model)
            endpoints = self.adapter_holders(model)
            if endpoints is None and not state.config.hold.enabled:
                raise ApiError(
                    503,
                    f"no replica holds the adapter `{model}` right now",
                    "service_unavailable_error",
                    param="model",
                    code="adapter_not_loaded",
                    headers=[(b"retry-after", b"5")],
                )
            if endpoints is None:
                return None
        if endpoints is None:
            if state.endpoints.declared.get(model) and state.config.hold.enabled:
                return None
            raise self._no_endpoints(model)
        return self.context_over(path, headers, body, model, endpoints, started)

    def adapter_holders(self, adapter: str) -> tuple[Endpoint, ...] | None:
        """The endpoints holding a LoRA adapter (None: none does, or not an adapter)."""
        endpoints = self.state.endpoints
        base = endpoints.adapters.get(adapter)
        found = holders(adapter, endpoints.for_model(base) or ()) if base is not None else ()
        return found or None

    async def wait_for(self, model: str) -> tuple[Endpoint, ...]:
        """Scale to zero: the first endpoint of ``model`` (or 503 past the timeout/bound)."""
        return await self.holds.wait(model)

    def context_over(
        self,
        path: str,
        headers: Headers,
        body: bytes,
        model: str,
        endpoints: tuple[Endpoint, ...],
        started: float,
    ) -> RequestContext:
        """The context of a request to be served by ``endpoints``."""
        deadlines = self._deadlines(model)
        forward = []
        for name in _FORWARD_REQUEST:
            value = headers.get(name)
            if value is not None:
                forward.append((name, value))
        return RequestContext(
            path=path,
            body=body,
            headers=forward,
            model=model,
            candidates=self._candidates(headers, model, endpoints),
            deadlines=deadlines,
            started=started,
            deadline=started + deadlines.total,
        )

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
                model=model,
            )
        return ApiError(
            404, f"The model `{model}` does not exist", param="model", code="model_not_found"
        )

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
