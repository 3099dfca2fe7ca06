"""Scale to zero, the router's side: hold requests for a model that has no replica yet.

A request for a model the control plane declares with `scale_to_zero` and no endpoint
waits here, at most `hold.max_held` per model and `hold.hold_timeout` each; the router
tells the control plane it has demand (``ReportDemand``, sent by the watcher), and every
held request goes on as soon as a snapshot brings the model's first endpoint. Past the
timeout or the bound the answer is 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

import structlog

from llmgw_router.endpoints import Endpoint
from llmgw_router.errors import ApiError
from llmgw_router.state import RouterState, now

__all__ = ["Holds"]

log = structlog.get_logger(__name__)


class Holds:
    def __init__(self, state: RouterState) -> None:
        self.state = state
        # A LoRA adapter's endpoints are those holding it (set by the proxy's Router).
        self.adapter_holders: Callable[[str], tuple[Endpoint, ...] | None] = lambda name: None
        self._changed: asyncio.Event | None = None
        state.on_endpoints.append(self._wake)

    def _wake(self) -> None:
        # Every waiter looks at the new endpoint set; a fresh event serves the next change.
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _busy(self, model: str, message: str, code: str, retry_after: float) -> ApiError:
        return ApiError(
            503,
            message,
            "service_unavailable_error",
            param="model",
            code=code,
            headers=[(b"retry-after", str(max(1, math.ceil(retry_after))).encode())],
            model=model,
        )

    async def wait(self, model: str) -> tuple[Endpoint, ...]:
        state = self.state
        cfg = state.config.hold
        held = state.held.get(model, 0)
        if held >= cfg.max_held:
            raise self._busy(
                model,
                f"the model `{model}` is starting and {held} requests already wait for it",
                "model_starting",
                cfg.hold_timeout / 4,
            )
        state.held[model] = held + 1
        state.demand(model)
        started = now()
        deadline = started + cfg.hold_timeout
        try:
            while True:
                adapter = model in state.endpoints.adapters
                endpoints = (
                    self.adapter_holders(model) if adapter else state.endpoints.for_model(model)
                )
                if endpoints:
                    log.info("held request released", model=model, waited=round(now() - started, 3))
                    return endpoints
                remaining = deadline - now()
                if adapter and remaining <= 0:
                    raise self._busy(
                        model,
                        f"no replica loaded the adapter `{model}` within {cfg.hold_timeout:g}s",
                        "adapter_not_loaded",
                        min(30.0, cfg.hold_timeout),
                    )
                if not adapter and (remaining <= 0 or not state.endpoints.declared.get(model)):
                    raise self._busy(
                        model,
                        f"the model `{model}` is scaled to zero and no replica became ready "
                        f"within {cfg.hold_timeout:g}s",
                        "model_starting",
                        min(30.0, cfg.hold_timeout),
                    )
                if self._changed is None:
                    self._changed = asyncio.Event()
                event = self._changed
                try:
                    async with asyncio.timeout(remaining):
                        await event.wait()
                except TimeoutError:
                    pass
        finally:
            left = state.held[model] - 1
            if left:
                state.held[model] = left
            else:
                del state.held[model]
