"""What an engine serves, and the spans of a shard's start (llmgw_proto.tracing).

Routes: at READY the agent reads the HTTP paths the engine serves, so the control plane
can tell routers which replica serves which route (ShardStatus.routes, then
Endpoint.routes). vLLM and SGLang list theirs in ``/openapi.json`` (FastAPI);
llama-server has no such list, so its routes are the ones its server registers
(llama.cpp's tools/server: chat and text completions, embeddings, Anthropic's messages,
rerank, tokenize, infill). Nothing known: an empty list, and routers send the replica
any route.

Spans, when tracing is on: ``agent.start_shard`` (the StartShard, a child of the control
plane's span whose traceparent the command carries) with ``agent.validate`` and
``agent.launch``; ``agent.load`` from launch to READY (or to the failure), a child of
``agent.start_shard``. Each ShardStatus carries the traceparent of the agent's span it
comes from, so the control plane's spans join the same trace.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from urllib.parse import urlsplit

import msgspec
import structlog
from llmgw_proto import tracing, v1

from llmgw_agent.probe import http_get

__all__ = [
    "LLAMA_SERVER_ROUTES",
    "forget",
    "launched",
    "load_done",
    "openapi_routes",
    "read_routes",
    "remember_routes",
    "routes_of",
    "stamp",
    "start_span",
]

log = structlog.get_logger(__name__)

# llama.cpp's tools/server registers these (POST); /v1/responses only in newer builds,
# so it is left out rather than guessed.
LLAMA_SERVER_ROUTES = (
    "/v1/chat/completions",
    "/chat/completions",
    "/v1/completions",
    "/completions",
    "/v1/embeddings",
    "/embeddings",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/rerank",
    "/rerank",
    "/v1/reranking",
    "/reranking",
    "/tokenize",
    "/detokenize",
    "/infill",
)
# Paths of a FastAPI app that are not the engine's API.
_NOT_API = frozenset({"/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"})
_METHODS = frozenset({"get", "post", "delete", "put"})
_MAX_ROUTES = 512
_MAX_PATH = 256

# Per shard: the routes read at READY; the traceparent of its start span and of its load
# span (what its ShardStatus messages carry).
_routes: dict[str, list[str]] = {}
_start_trace: dict[str, str] = {}
_status_trace: dict[str, str] = {}


class _OpenApi(msgspec.Struct):
    paths: dict[str, dict[str, msgspec.Raw]] = {}


def openapi_routes(body: bytes) -> list[str]:
    """The API paths an ``/openapi.json`` lists (sorted, bounded); [] when it is not one."""
    try:
        doc = msgspec.json.decode(body, type=_OpenApi)
    except msgspec.DecodeError:
        return []
    out = {
        path
        for path, ops in doc.paths.items()
        if path.startswith("/")
        and len(path) <= _MAX_PATH
        and path not in _NOT_API
        and any(m.lower() in _METHODS for m in ops)
    }
    return sorted(out)[:_MAX_ROUTES]


async def read_routes(kind: v1.EngineKind, engine_url: str, api_key: str = "") -> list[str]:
    """The paths the engine serves (``engine_url``: any URL of it, its health check's);
    [] when they cannot be read."""
    if kind == v1.EngineKind.LLAMACPP:
        return list(LLAMA_SERVER_ROUTES)
    parts = urlsplit(engine_url)
    if not parts.scheme or not parts.netloc:
        return []
    base_url = f"{parts.scheme}://{parts.netloc}"
    try:
        status, body = await http_get(base_url + "/openapi.json", timeout=10.0, api_key=api_key)
    except (OSError, TimeoutError) as err:
        log.warning("engine routes not read", url=base_url, error=str(err))
        return []
    if status != 200:
        log.warning("engine routes not read", url=base_url, status=status)
        return []
    return openapi_routes(body)


def remember_routes(shard_id: str, routes: Iterable[str]) -> None:
    _routes[shard_id] = list(routes)


def routes_of(shard_id: str) -> list[str]:
    return list(_routes.get(shard_id, ()))


def start_span(start: v1.StartShard) -> contextlib.AbstractContextManager[tracing.NoSpan]:
    """``agent.start_shard``: validation and launch, under the control plane's span."""
    return tracing.span(
        "agent.start_shard",
        parent=start.traceparent or None,
        shard=start.shard_id,
        replica=start.replica_id,
        model=start.model,
        profile=start.profile,
        port=start.port,
        gpus=",".join(str(g) for g in start.gpu_indices),
    )


def launched(shard_id: str) -> None:
    """Inside ``agent.start_shard`` after a launch: the parent of its load span."""
    tp = tracing.traceparent()
    if tp:
        _start_trace[shard_id] = tp


def load_done(shard_id: str, started_at: float, outcome: str) -> None:
    """``agent.load``: from the launch (``started_at``, epoch seconds) to now."""
    parent = _start_trace.pop(shard_id, None)
    if parent is None or not tracing.enabled():
        return
    tp = tracing.record(
        "agent.load",
        time.time() - started_at,
        parent=parent,
        shard=shard_id,
        outcome=outcome,
        routes=len(_routes.get(shard_id, ())),
    )
    if tp:
        _status_trace[shard_id] = tp


def stamp(status: v1.ShardStatus) -> v1.ShardStatus:
    """The status with its routes (at READY) and the traceparent of the agent's span."""
    if status.state == v1.ShardState.READY:
        status.routes = routes_of(status.shard_id)
    if not status.traceparent:
        status.traceparent = _status_trace.get(status.shard_id) or tracing.traceparent() or ""
    return status


def forget(shard_id: str) -> None:
    _routes.pop(shard_id, None)
    _start_trace.pop(shard_id, None)
    _status_trace.pop(shard_id, None)
