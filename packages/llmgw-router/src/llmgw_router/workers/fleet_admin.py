"""The supervisor's admin listener: `/metrics` summed over the workers, `/healthz`,
`/readyz` of the fleet, `/v1/endpoints` with the workers' counts added, `/v1/workers`;
anything else from any one worker's own admin app (a Unix socket each)."""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import msgspec

from llmgw_router.workers.merge import MetricsMerger, per_worker
from llmgw_router.workers.slots import Slot

__all__ = ["Fleet", "fleet_admin_app"]


class Fleet(Protocol):
    """What the admin app reads of the supervisor (supervisor.py)."""

    workers: int
    slots: list[Slot]
    metrics: MetricsMerger
    stopping: bool
    ever_up: bool
    all_ready_once: bool

    def session(self, slot: Slot) -> Any: ...

    async def get(self, slot: Slot, path: str, timeout: float = 5.0) -> tuple[int, bytes, str]: ...

    async def fan_out(self, path: str) -> list[tuple[Slot, int, bytes, str]]: ...


def fleet_admin_app(sup: Fleet) -> Any:
    """The supervisor's admin app: the fleet's answers from the workers' own."""
    from aiohttp import web

    async def metrics(request: web.Request) -> web.Response:
        results = await sup.fan_out("/metrics")
        scrapes = {
            s.proc.pid: body.decode() for s, status, body, _ in results if s.proc and status == 200
        }
        samples = sup.metrics.merge(scrapes)
        by_worker = {
            s.index: per_worker(body.decode()) for s, status, body, _ in results if status == 200
        }
        body = sup.metrics.render(samples, _own_metrics(sup, by_worker))
        from prometheus_client import CONTENT_TYPE_LATEST

        return web.Response(body=body, headers={"content-type": CONTENT_TYPE_LATEST})

    async def healthz(request: web.Request) -> web.Response:
        # Like a single router's: 200 once something serves the port, then while the
        # supervisor runs (a worker being replaced does not make the router unhealthy).
        up = sum(1 for s in sup.slots if s.up and s.proc is not None)
        if not sup.ever_up:
            return web.json_response({"status": "starting", "workers": up}, status=503)
        return web.json_response({"status": "ok", "workers": up})

    async def readyz(request: web.Request) -> web.Response:
        if sup.stopping:
            return web.json_response({"ready": False, "reason": "shutting down"}, status=503)
        results = await sup.fan_out("/readyz")
        ready = [r for r in results if r[1] == 200]
        if len(ready) == sup.workers:
            sup.all_ready_once = True
        if ready and sup.all_ready_once:
            answer = msgspec.json.decode(ready[0][2])
            answer["workers"] = len(ready)
            return web.json_response(answer)
        reason = f"{len(ready)} of {sup.workers} workers ready"
        if results and not ready:
            with contextlib.suppress(Exception):
                reason = msgspec.json.decode(results[0][2]).get("reason", reason)
        return web.json_response({"ready": False, "reason": reason}, status=503)

    async def endpoints(request: web.Request) -> web.Response:
        results = [r for r in await sup.fan_out("/v1/endpoints") if r[1] == 200]
        if not results:
            return web.json_response({"error": "no worker answered"}, status=503)
        merged = msgspec.json.decode(results[0][2])
        # The workers' counts of one endpoint add up; each worker records the prefixes it
        # sent there, so the engine holds at least the largest record; the rest is the
        # first worker's view.
        summed = ("outstanding", "awaiting_first_byte", "pending_prefill_blocks")
        largest = ("live_prefix_blocks",)
        totals: dict[tuple[str, str], float] = {}
        states: dict[str, list[str]] = {}
        for _, _, body, _ in results:
            for ep in msgspec.json.decode(body).get("endpoints", []):
                for key in summed:
                    at = (ep["id"], key)
                    totals[at] = totals.get(at, 0) + ep.get(key, 0)
                for key in largest:
                    at = (ep["id"], key)
                    totals[at] = max(totals.get(at, 0), ep.get(key, 0))
                states.setdefault(ep["id"], []).append(ep.get("state", ""))
        for ep in merged.get("endpoints", []):
            for key in (*summed, *largest):
                if key in ep:
                    value = totals.get((ep["id"], key), ep[key])
                    ep[key] = round(value, 1) if isinstance(value, float) else value
            # Each worker's own view, in worker order (they agree but for moments).
            ep["state_by_worker"] = states.get(ep["id"], [])
        merged["workers"] = len(results)
        merged["engine_cache_picks"] = sum(
            msgspec.json.decode(body).get("engine_cache_picks", 0) for _, _, body, _ in results
        )
        return web.json_response(merged)

    async def workers(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "workers": [
                    {
                        "index": s.index,
                        "pid": s.proc.pid if s.proc is not None else None,
                        "up": s.up and s.proc is not None,
                        "restarts": s.restarts,
                        "exits": s.history[-5:],
                    }
                    for s in sup.slots
                ]
            }
        )

    async def other(request: web.Request) -> web.Response:
        # Anything else the admin app serves: any one worker's answer.
        for slot in sup.slots:
            if slot.up and slot.proc is not None:
                with contextlib.suppress(Exception):
                    status, body, kind = await sup.get(slot, request.path_qs)
                    return web.Response(status=status, body=body, headers={"content-type": kind})
        return web.json_response({"error": "no worker answered"}, status=503)

    async def match(request: web.Request) -> web.Response:
        # Precise matching explained (POST /v1/match): any one worker's answer; they
        # hear the same engine caches.
        import aiohttp

        body = await request.read()
        for slot in sup.slots:
            if slot.up and slot.proc is not None:
                with contextlib.suppress(Exception):
                    async with sup.session(slot).post(
                        "http://worker/v1/match",
                        data=body,
                        timeout=aiohttp.ClientTimeout(total=5.0),
                    ) as resp:
                        return web.Response(
                            status=resp.status,
                            body=await resp.read(),
                            headers={"content-type": resp.headers.get("content-type", "")},
                        )
        return web.json_response({"error": "no worker answered"}, status=503)

    app = web.Application()
    app.router.add_post("/v1/match", match)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/v1/endpoints", endpoints)
    app.router.add_get("/v1/workers", workers)
    app.router.add_route("GET", "/{tail:.*}", other)
    return app


def _own_metrics(sup: Fleet, by_worker: dict[int, tuple[float, float]]) -> list[Any]:
    from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

    up = GaugeMetricFamily("llmgw_router_workers", "Worker processes, by state.", labels=["state"])
    up.add_metric(["configured"], sup.workers)
    up.add_metric(["up"], sum(1 for s in sup.slots if s.up and s.proc is not None))
    restarts = CounterMetricFamily(
        "llmgw_router_worker_restarts", "Workers started again after one died."
    )
    restarts.add_metric([], sum(s.restarts for s in sup.slots))
    requests = CounterMetricFamily(
        "llmgw_router_worker_requests",
        "Requests answered by each worker process (since that process started).",
        labels=["worker"],
    )
    in_flight = GaugeMetricFamily(
        "llmgw_router_worker_in_flight",
        "Requests in flight in each worker process.",
        labels=["worker"],
    )
    for index, (count, flying) in sorted(by_worker.items()):
        requests.add_metric([str(index)], count)
        in_flight.add_metric([str(index)], flying)
    return [up, restarts, requests, in_flight]
