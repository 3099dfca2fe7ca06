"""The simulated engine's HTTP API (on :mod:`httpserver`) over the pure model in :mod:`model`:
the route table of each engine kind. The handlers live by concern in :mod:`routes_common`,
:mod:`routes_engine` and :mod:`generation` (all on :mod:`handlers`); the engine's state in
:mod:`engine`."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

import msgspec

from llmgw_sim.engine import ERROR_HEADER, ERROR_MESSAGE_HEADER, Engine
from llmgw_sim.generation import STALL_HEADER, GenerationRoutes
from llmgw_sim.httpserver import Request, Response, Stream
from llmgw_sim.routes_common import CommonRoutes
from llmgw_sim.routes_engine import LlamaRoutes, SglangRoutes, VllmRoutes
from llmgw_sim.routes_more import MoreRoutes
from llmgw_sim.script import HANG, Script, ScriptError

__all__ = [
    "ERROR_HEADER",
    "ERROR_MESSAGE_HEADER",
    "STALL_HEADER",
    "Engine",
    "Route",
    "build_app",
]

Route = Callable[[Request], Awaitable["Response | Stream"]]


def build_app(engine: Engine, *, health_only: bool = False) -> Route:
    """The engine's routes as one request handler for :class:`HttpServer`."""
    common = CommonRoutes(engine)
    gen = GenerationRoutes(engine)
    vllm = VllmRoutes(engine)
    sglang = SglangRoutes(engine)
    llama = LlamaRoutes(engine)
    more = MoreRoutes(engine)
    get: dict[str, Route] = {"/health": common.health}
    post: dict[str, Route] = {}
    if engine.kind == "sglang":
        get["/health_generate"] = common.health
    if not health_only:
        get["/metrics"] = common.metrics
        get["/v1/models"] = common.models
        post["/v1/chat/completions"] = gen.chat
        post["/v1/completions"] = gen.completions
        post["/v1/embeddings"] = common.embeddings
        if engine.kind in ("vllm", "sglang"):
            get["/version"] = vllm.version
        if engine.kind == "vllm" and engine.config.runtime_lora_updating:
            post["/v1/load_lora_adapter"] = vllm.load_lora
            post["/v1/unload_lora_adapter"] = vllm.unload_lora
        if engine.kind == "sglang" and engine.config.runtime_lora_updating:
            post["/load_lora_adapter"] = sglang.load_lora
            post["/unload_lora_adapter"] = sglang.unload_lora
        if engine.kind == "vllm":
            post["/tokenize"] = vllm.tokenize
            post["/detokenize"] = vllm.detokenize
        if engine.kind == "sglang":
            get["/get_model_info"] = sglang.model_info
            get["/get_server_info"] = sglang.server_info
        if engine.kind == "llama-server":
            get["/v1/health"] = common.health
            get["/models"] = common.models
            get["/props"] = llama.props
            post["/chat/completions"] = gen.chat
            post["/completions"] = gen.completions
            post["/embeddings"] = common.embeddings
        # Responses, messages, rerank, score, audio, ... and /openapi.json (routes_more).
        more_get, more_post = more.table()
        get.update(more_get)
        post.update(more_post)
    if engine.knobs.script_routes:
        _add_script_routes(engine, get, post, health_only=health_only)
    routes = {"GET": get, "HEAD": get, "POST": post}
    not_found = Response(404, b'{"detail":"Not Found"}', "application/json")
    not_allowed = Response(405, b'{"detail":"Method Not Allowed"}', "application/json")

    async def handle(request: Request) -> Response | Stream:
        table = routes.get(request.method)
        route = table.get(request.path) if table is not None else None
        if route is None and not health_only:
            route = more.stored_route(request)
        if route is not None:
            result: Response | Stream = await route(request)
            return result
        if any(request.path in t for t in (get, post)):
            return not_allowed
        return not_found

    return handle


_INFERENCE = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/chat/completions",
     "/completions", "/embeddings"}
)  # fmt: skip


def _add_script_routes(
    engine: Engine, get: dict[str, Route], post: dict[str, Route], *, health_only: bool
) -> None:
    """``--sim-script-routes``: /sim/script and /sim/stats, and the inference routes and
    /health wrapped to obey the script and to count."""
    script = Script()
    json = "application/json"

    def counted(route: Route) -> Route:
        async def run(request: Request) -> Response | Stream:
            counts = script.counts
            counts["started"] += 1
            counts["in_flight"] += 1
            try:
                failure = script.next_failure()
                if failure == HANG:
                    await asyncio.Event().wait()  # until the client leaves
                if failure is not None:
                    return engine.error(failure, f"Scripted failure {failure}")
                result = await route(request)
                if isinstance(result, Stream) or result.status < 400:
                    counts["completed"] += 1
                return result
            except asyncio.CancelledError:
                counts["cancelled"] += 1
                raise
            finally:
                counts["in_flight"] -= 1

        return run

    def health(route: Route) -> Route:
        async def run(request: Request) -> Response | Stream:
            if not script.healthy:
                return Response(status=503)
            return await route(request)

        return run

    async def set_script(request: Request) -> Response:
        try:
            script.update(msgspec.json.decode(request.body or b"null"))
            itl = engine.knobs.itl if script.itl is None else script.itl
            engine.timing = dataclasses.replace(engine.timing, itl=itl)
        except (ScriptError, msgspec.DecodeError) as err:
            return Response(400, msgspec.json.encode({"error": str(err)}), json)
        return Response(body=msgspec.json.encode(script.state()), content_type=json)

    async def stats(request: Request) -> Response:
        return Response(body=msgspec.json.encode(script.counts), content_type=json)

    async def kv_stats(request: Request) -> Response:
        # Disaggregated prefill (llmgw_sim.kvtransfer): transfers issued, received, refused.
        return Response(body=msgspec.json.encode(engine.kv_counts), content_type=json)

    for path in [p for p in post if p in _INFERENCE]:
        post[path] = counted(post[path])
    for path in [p for p in get if p in ("/health", "/health_generate", "/v1/health")]:
        get[path] = health(get[path])
    if not health_only:
        post["/sim/script"] = set_script
        get["/sim/stats"] = stats
        get["/sim/kv"] = kv_stats
