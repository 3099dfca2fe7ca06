"""The admin app (default 127.0.0.1:9090): metrics, liveness, readiness, endpoints."""

from __future__ import annotations

import time
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmgw_router.balancing import CacheAware
from llmgw_router.endpoints import Endpoint
from llmgw_router.state import RouterState

__all__ = ["admin_app"]


def admin_app(state: RouterState) -> Starlette:
    def refresh_gauges() -> None:
        now = time.monotonic()
        counts = {"ready": 0, "ejected": 0, "unhealthy": 0}
        for ep in state.endpoints.endpoints:
            counts[ep.state(now)] = counts.get(ep.state(now), 0) + 1
        for name, count in counts.items():
            state.metrics.endpoints.labels(name).set(count)
        state.metrics.token_cache_bytes.set(state.token_cache.bytes)
        # In-flight counts live on the endpoints; the gauge is filled in at scrape time
        # rather than moved twice on every request.
        metrics = state.metrics
        in_flight = metrics.in_flight
        in_flight.clear()
        for gauge in (
            metrics.engine_running,
            metrics.engine_waiting,
            metrics.engine_kv_cache_usage,
            metrics.endpoint_load,
            metrics.held,
        ):
            gauge.clear()
        for ep in state.endpoints.endpoints:
            in_flight.labels(ep.id).set(ep.outstanding)
            engine = ep.fresh_engine(now)
            if engine is not None:
                metrics.engine_running.labels(ep.id).set(engine.running)
                metrics.engine_waiting.labels(ep.id).set(engine.waiting)
                metrics.engine_kv_cache_usage.labels(ep.id).set(engine.kv_cache_usage)
            source = "engine" if engine is not None else "router"
            metrics.endpoint_load.labels(ep.id, source).set(ep.load_at(now))
        for model, held in state.held.items():
            metrics.held.labels(model).set(held)

    async def metrics(request: Request) -> Response:
        refresh_gauges()
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        endpoints = state.endpoints
        if state.draining:
            return JSONResponse({"ready": False, "reason": "shutting down"}, status_code=503)
        if len(endpoints) == 0 and not (state.has_snapshot and endpoints.declared):
            # A snapshot that declares models, all scaled to zero, is something to serve:
            # requests for them are held until a replica starts.
            return JSONResponse({"ready": False, "reason": "no endpoints yet"}, status_code=503)
        return JSONResponse(
            {"ready": True, "endpoints": len(endpoints), "version": endpoints.version}
        )

    def footprint(ep: Endpoint) -> int:
        balancer = state.balancer
        return balancer.footprint(ep) if isinstance(balancer, CacheAware) else 0

    def prefix_keys() -> dict[str, Any] | None:
        balancer = state.balancer
        if not isinstance(balancer, CacheAware) or not balancer.shared_homes:
            return None
        own, fleet = balancer.recent_keys(), balancer.fleet_keys()
        return {
            "own": len(own),
            "fleet": len(fleet),
            "own_keys": [f"{k:016x}" for k in sorted(own)[:256]],
            "fleet_keys": [f"{k:016x}" for k in sorted(fleet)[:256]],
        }

    def engine_view(ep: Endpoint, now: float) -> dict[str, Any] | None:
        engine = ep.fresh_engine(now)
        if engine is None:
            return None
        return {
            "running": engine.running,
            "waiting": engine.waiting,
            "kv_cache_usage": round(engine.kv_cache_usage, 4),
            "prefix_cache_queries": engine.prefix_cache_queries,
            "prefix_cache_hits": engine.prefix_cache_hits,
            "generation": engine.generation,
            "prefill_tokens_per_second": round(engine.prefill_tokens_per_second, 1),
            "age": round(now - engine.measured_at, 3),
        }

    async def endpoints(request: Request) -> Response:
        now = time.monotonic()
        current = state.endpoints
        return JSONResponse(
            {
                "version": current.version,
                "source": current.source,
                "balancer": state.config.balancer,
                # Precise matching: picks where the engines' reported caches (their
                # blocks named by token ids) named where the prompt is held.
                "engine_cache_picks": getattr(state.balancer, "engine_cache_picks", 0),
                # shared_homes: the prefixes of this router's window and the fleet's (from
                # the control plane's SharePrefixes), as hex keys, 256 at most each.
                "prefix_keys": prefix_keys(),
                "control": {
                    "address": state.control.address,
                    "connected": state.control.connected,
                    "reason": state.control.reason,
                }
                if state.config.control is not None
                else None,
                "declared": dict(current.declared),
                "held": dict(state.held),
                # Tenants: the fair-share queues (held per priority and key, the oldest
                # wait) and each key's limits at this router now.
                "tenants": state.tenants.view() if state.tenants is not None else None,
                "endpoints": [
                    {
                        "id": ep.id,
                        "url": ep.url,
                        "models": list(ep.spec.models),
                        "profile": ep.spec.profile,
                        "weight": ep.weight,
                        "node_id": ep.spec.node_id,
                        "replica_id": ep.spec.replica_id,
                        "slot": ep.spec.slot,
                        "state": ep.state(now),
                        "healthy": ep.healthy,
                        "outstanding": ep.outstanding,
                        "awaiting_first_byte": ep.awaiting_first,
                        # cache_aware's predicted time to first token: the engine's cache
                        # (tokens, as reported or configured; 0 unknown) and in prefix
                        # blocks, this router's live prefix blocks there, its prefill
                        # queued there (blocks) and the seconds per block it predicts
                        # with: from the engine's reported prefill rate where there is
                        # one (block_time_from "engine"), else learnt from this router's
                        # times to first byte ("router").
                        "cache_tokens": ep.cache_tokens,
                        "cache_blocks": ep.cache_blocks,
                        "live_prefix_blocks": footprint(ep),
                        "pending_prefill_blocks": round(ep.pending_blocks, 1),
                        "block_time": round(ep.block_time, 6),
                        "block_time_from": "engine"
                        if ep.engine is not None and ep.engine.prefill_tokens_per_second > 0
                        else "router",
                        "consecutive_failures": ep.outlier.consecutive_failures,
                        "ejections": ep.outlier.ejections,
                        "ejected_for": round(max(0.0, ep.outlier.ejected_until - now), 3),
                        # Routing that sees the engines: their last report (null when
                        # unknown or older than load_reports.max_age), this router's
                        # requests sent and finished since it, and the load the balancer weighs.
                        "engine": engine_view(ep, now),
                        "sent_since_report": ep.sent_since_report,
                        "finished_since_report": ep.finished_since_report,
                        "load": round(ep.load_at(now), 4),
                        "load_source": "engine" if ep.fresh_engine(now) else "router",
                        "generation": ep.generation,
                        "cached_blocks": ep.cached_blocks,
                        # Precise matching: the blocks named by their token ids (null
                        # when the engine's events carry none) and their size.
                        "token_blocks": len(ep.token_blocks)
                        if ep.token_blocks is not None
                        else None,
                        "token_block_size": ep.token_block_size or None,
                        "prefix_blocks": state.balancer.remembered(ep.id),
                    }
                    for ep in current.endpoints
                ],
            }
        )

    async def match(request: Request) -> Response:
        """Precise matching, explained: for a chat or completion request body, the prompt's
        tokens as this router counts them and, per endpoint of its model, how many of its
        leading blocks that endpoint's engine reports cached."""
        try:
            body = msgspec.json.decode(await request.body())
        except msgspec.DecodeError as err:
            return JSONResponse({"error": f"the body is not JSON: {err}"}, status_code=400)
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            return JSONResponse({"error": "the body needs a `model` string"}, status_code=400)
        model = body["model"]
        # A LoRA adapter's prompt is its base model's tokens, its blocks chained from the
        # adapter's root (as its engines' cache events name them).
        base = state.endpoints.adapters.get(model)
        # The proxy's own tokenizer and cache: what it counts is what the proxy counts.
        tokenizer = state.tokenizer(base or model)
        if tokenizer is None:
            return JSONResponse(
                {
                    "error": f"no tokenizer for {base or model!r}"
                    + (f" (the base model of adapter {model!r})" if base else "")
                    + " in cache_aware.tokenizers"
                },
                status_code=404,
            )
        max_blocks = state.config.cache_aware.max_blocks
        if "messages" in body:
            blocks = await tokenizer.chat_blocks(body["messages"], max_blocks)
        else:
            blocks = await tokenizer.completion_blocks(body.get("prompt"), max_blocks)
        if blocks is None:
            return JSONResponse({"model": model, "prompt_tokens": None, "endpoints": []})
        if base is not None:
            blocks = blocks.under(model)
        tokens = blocks.tokens
        return JSONResponse(
            {
                "model": model,
                "prompt_tokens": len(tokens),
                "endpoints": [
                    {
                        "id": ep.id,
                        "token_block_size": ep.token_block_size or None,
                        "prompt_blocks": len(blocks.hashes(ep.token_block_size))
                        if ep.token_block_size
                        else None,
                        "cached_blocks": blocks.cached(ep.token_blocks, ep.token_block_size),
                    }
                    for ep in state.endpoints.for_model(base or model) or ()
                ],
            }
        )

    return Starlette(
        routes=[
            Route("/metrics", metrics),
            Route("/healthz", healthz),
            Route("/readyz", readyz),
            Route("/v1/endpoints", endpoints),
            Route("/v1/match", match, methods=["POST"]),
        ]
    )
