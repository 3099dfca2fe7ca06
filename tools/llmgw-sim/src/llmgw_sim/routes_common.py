"""The routes every engine kind serves: health, the model listing, metrics, embeddings."""

from __future__ import annotations

import base64
import hashlib
import math
import random
import struct
import time
from typing import Any

import msgspec

from llmgw_sim import metrics
from llmgw_sim.handlers import Handlers
from llmgw_sim.httpserver import Request, Response
from llmgw_sim.model import tokenize
from llmgw_sim.protocol import parse_embedding

_enc = msgspec.json.encode
_JSON = "application/json"


class CommonRoutes(Handlers):
    """/health, /v1/models, /metrics and /v1/embeddings, answered as each engine kind does."""

    async def health(self, request: Request) -> Response:
        eng = self.engine
        if self.kind == "llama-server":
            if not eng.ready:
                return eng.loading_response()
            return Response(body=b'{"status":"ok"}', content_type=_JSON)
        if not eng.ready:
            return Response(status=503)
        return Response(status=200)

    async def models(self, request: Request) -> Response:
        eng = self.engine
        if self.kind == "llama-server":
            if not eng.ready:
                return eng.loading_response()  # the listing is public in llama.cpp
        else:
            gate = self._gate(request, inference=False)
            if gate is not None:
                return gate
        cfg = self.engine.config
        created = self.engine.created
        data: list[dict[str, Any]] = []
        for name in cfg.served_names:
            entry: dict[str, Any] = {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": {"vllm": "vllm", "sglang": "sglang"}.get(self.kind, "llamacpp"),
            }
            if self.kind == "vllm":
                entry.update(root=cfg.model, parent=None, max_model_len=cfg.max_model_len)
                entry["permission"] = [
                    {
                        "id": f"modelperm-{self.engine.new_id('')}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ]
            elif self.kind == "sglang":
                entry.update(root=name, max_model_len=cfg.max_model_len)
            else:
                entry["meta"] = {"n_ctx_train": cfg.max_model_len, "n_vocab": 32000}
            data.append(entry)
        for name, path in eng.loras.items():
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": path,
                    "parent": cfg.primary_name,
                    "max_model_len": None,
                }
            )
        body: dict[str, Any] = {"object": "list", "data": data}
        if self.kind == "llama-server":
            body["models"] = [
                {"name": n, "model": n, "type": "model", "capabilities": ["completion"]}
                for n in cfg.served_names
            ]
        return Response(body=_enc(body), content_type=_JSON)

    async def metrics(self, request: Request) -> Response:
        eng = self.engine
        if not eng.config.metrics_enabled:
            if self.kind == "llama-server":
                return eng.error(
                    501, "This server does not support metrics endpoint. Start it with `--metrics`"
                )
            return Response(status=404, text="Not Found")
        if self.kind == "llama-server":
            if not eng.ready:
                return eng.loading_response()
            if not eng.authorized(request):
                return eng.unauthorized()
        text = metrics.render(self.kind, eng.stats, eng.config.primary_name)
        return Response(
            body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
        )

    # ----- embeddings -------------------------------------------------------

    async def embeddings(self, request: Request) -> Response:
        eng = self.engine
        req = self._admit(request, parse_embedding)
        if isinstance(req, Response):
            return req
        size = eng.knobs.embedding_dim
        dim = size
        if req.dimensions is not None:
            # The simulated model is Matryoshka-style: any length up to its embedding
            # size. vLLM's PoolingParams.verify refuses the rest (a 400 before any work),
            # so a huge "dimensions" can never tie up the event loop.
            if not 1 <= req.dimensions <= size:
                return eng.error(
                    400,
                    f"Model {eng.config.primary_name!r} only supports dimensions in range "
                    f"[1, {size}], got {req.dimensions}.",
                )
            dim = req.dimensions
        data: list[dict[str, Any]] = []
        prompt_tokens = 0
        for i, item in enumerate(req.inputs):
            tokens: list[Any] = tokenize(item, eng.token_cap) if isinstance(item, str) else item
            prompt_tokens += len(tokens)
            if len(tokens) > eng.config.max_model_len:
                more = "at least " if len(tokens) >= eng.token_cap else ""
                return eng.error(
                    400,
                    f"This model's maximum context length is {eng.config.max_model_len} tokens. "
                    f"However, you requested {more}{len(tokens)} tokens in the input for "
                    "embedding generation. Please reduce the length of the input.",
                )
            vec = _embedding(item, dim)
            emb: Any = vec
            if req.encoding_format == "base64":
                emb = base64.b64encode(struct.pack(f"<{dim}f", *vec)).decode()
            data.append({"index": i, "object": "embedding", "embedding": emb})
        eng.stats.prompt_tokens += prompt_tokens
        body = {
            "id": eng.new_id("embd-"),
            "object": "list",
            "created": int(time.time()),
            "model": eng.config.primary_name if req.model is None else req.model,
            "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }
        return Response(body=_enc(body), content_type=_JSON)


def _embedding(item: str | list[int], dim: int) -> list[float]:
    """A deterministic unit vector derived from the input."""
    # A stable digest (not hash()) so every process gives the same vector.
    raw = item.encode() if isinstance(item, str) else b",".join(b"%d" % t for t in item)
    rng = random.Random(hashlib.blake2b(raw, digest_size=8).digest())
    vec = [rng.uniform(-1.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [v / norm for v in vec]
