"""What every route handler shares: the engine, and the checks a request passes first."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from llmgw_sim.engine import Engine
from llmgw_sim.httpserver import Request, Response
from llmgw_sim.protocol import BadRequest, decode_body


class _Named(Protocol):
    @property
    def model(self) -> str | None: ...


_Req = TypeVar("_Req", bound=_Named)


class Handlers:
    """Route handlers over one engine; one instance per engine process."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.kind = engine.kind

    # ----- guards -----------------------------------------------------------

    def _admit(self, request: Request, parse: Callable[[dict[str, Any]], _Req]) -> _Req | Response:
        """What every inference route checks first: the gate, the body, the model and any
        injected error. Returns the parsed request, or the answer to send instead."""
        body = self._body(request, inference=True)
        if isinstance(body, Response):
            return body
        try:
            req = parse(body)
        except BadRequest as err:
            return self.engine.error(400, str(err))
        bad = self.engine.check_model(req.model) or self.engine.injected_error(request)
        return bad if bad is not None else req

    def _body(self, request: Request, *, inference: bool) -> dict[str, Any] | Response:
        """The gate, then the JSON body: the body, or the answer to send instead."""
        gate = self._gate(request, inference=inference)
        if gate is not None:
            return gate
        try:
            return decode_body(request.body)
        except BadRequest as err:
            return self.engine.error(400, str(err))

    def _gate(self, request: Request, *, inference: bool) -> Response | None:
        eng = self.engine
        if not eng.ready:
            return eng.loading_response()
        if inference and eng.draining:
            return eng.error(503, "The server is shutting down.", {"Connection": "close"})
        if not eng.authorized(request):
            return eng.unauthorized()
        return None
