"""The admin app (default 127.0.0.1:9090): metrics, liveness, readiness, endpoints."""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmgw_router.proxy import RouterState

__all__ = ["admin_app"]


def admin_app(state: RouterState) -> Starlette:
    def refresh_gauges() -> None:
        now = time.monotonic()
        counts = {"ready": 0, "ejected": 0, "unhealthy": 0}
        for ep in state.endpoints.endpoints:
            counts[ep.state(now)] = counts.get(ep.state(now), 0) + 1
        for name, count in counts.items():
            state.metrics.endpoints.labels(name).set(count)
        # In-flight counts live on the endpoints; the gauge is filled in at scrape time
        # rather than moved twice on every request.
        in_flight = state.metrics.in_flight
        in_flight.clear()
        for ep in state.endpoints.endpoints:
            in_flight.labels(ep.id).set(ep.outstanding)

    async def metrics(request: Request) -> Response:
        refresh_gauges()
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        endpoints = state.endpoints
        if state.draining:
            return JSONResponse({"ready": False, "reason": "shutting down"}, status_code=503)
        if len(endpoints) == 0:
            return JSONResponse({"ready": False, "reason": "no endpoints yet"}, status_code=503)
        return JSONResponse(
            {"ready": True, "endpoints": len(endpoints), "version": endpoints.version}
        )

    async def endpoints(request: Request) -> Response:
        now = time.monotonic()
        current = state.endpoints
        return JSONResponse(
            {
                "version": current.version,
                "source": current.source,
                "endpoints": [
                    {
                        "id": ep.id,
                        "url": ep.url,
                        "models": list(ep.spec.models),
                        "profile": ep.spec.profile,
                        "weight": ep.weight,
                        "node_id": ep.spec.node_id,
                        "replica_id": ep.spec.replica_id,
                        "state": ep.state(now),
                        "healthy": ep.healthy,
                        "outstanding": ep.outstanding,
                        "consecutive_failures": ep.outlier.consecutive_failures,
                        "ejections": ep.outlier.ejections,
                        "ejected_for": round(max(0.0, ep.outlier.ejected_until - now), 3),
                    }
                    for ep in current.endpoints
                ],
            }
        )

    return Starlette(
        routes=[
            Route("/metrics", metrics),
            Route("/healthz", healthz),
            Route("/readyz", readyz),
            Route("/v1/endpoints", endpoints),
        ]
    )
