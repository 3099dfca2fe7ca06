"""The simulated engine's HTTP API (on :mod:`httpserver`) over the pure model in :mod:`model`:
the route table of each engine kind. The handlers live by concern in :mod:`routes_common`,
:mod:`routes_engine` and :mod:`generation` (all on :mod:`handlers`); the engine's state in
:mod:`engine`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from llmgw_sim.engine import ERROR_HEADER, ERROR_MESSAGE_HEADER, Engine
from llmgw_sim.generation import STALL_HEADER, GenerationRoutes
from llmgw_sim.httpserver import Request, Response, Stream
from llmgw_sim.routes_common import CommonRoutes
from llmgw_sim.routes_engine import LlamaRoutes, SglangRoutes, VllmRoutes

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
    routes = {"GET": get, "HEAD": get, "POST": post}
    not_found = Response(404, b'{"detail":"Not Found"}', "application/json")
    not_allowed = Response(405, b'{"detail":"Method Not Allowed"}', "application/json")

    async def handle(request: Request) -> Response | Stream:
        table = routes.get(request.method)
        route = table.get(request.path) if table is not None else None
        if route is not None:
            result: Response | Stream = await route(request)
            return result
        if any(request.path in t for t in (get, post)):
            return not_allowed
        return not_found

    return handle
