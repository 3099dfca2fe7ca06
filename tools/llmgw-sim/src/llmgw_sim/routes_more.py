"""The engines' other routes: the Responses API (with stored responses and
``previous_response_id``), Anthropic's Messages API, rerank and score, pooling and
classification, audio transcription and translation, and ``/openapi.json`` naming the
routes this engine serves (what the agent reads to know them).

The answers are deterministic (the same request gets the same text), shaped as vLLM's;
each echoes the W3C ``traceparent`` it was sent as ``X-Sim-Traceparent`` so tests see
what reached the engine.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

import msgspec

from llmgw_sim.handlers import Handlers
from llmgw_sim.httpserver import Request, Response, Stream
from llmgw_sim.model import greedy_tokens, tokenize

__all__ = ["MoreRoutes", "served_paths"]

_enc = msgspec.json.encode
_JSON = "application/json"
_SSE = "text/event-stream"
_DEFAULT_OUTPUT = 8
_MAX_OUTPUT = 4096
# Stored responses kept per engine (the oldest go first).
_MAX_STORED = 10_000

Route = Callable[[Request], Awaitable["Response | Stream"]]

# What each engine kind serves besides chat, completions and embeddings (POST unless
# said; "{id}" paths are matched by prefix).
_VLLM_PATHS = (
    "/v1/responses",
    "/v1/messages",
    "/v1/rerank",
    "/rerank",
    "/v2/rerank",
    "/v1/score",
    "/score",
    "/pooling",
    "/classify",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
)
_SGLANG_PATHS = ("/v1/responses", "/v1/rerank", "/v1/score", "/classify")
_LLAMA_PATHS = ("/v1/messages", "/v1/rerank", "/rerank", "/reranking", "/v1/reranking")


def served_paths(kind: str) -> tuple[str, ...]:
    return {"vllm": _VLLM_PATHS, "sglang": _SGLANG_PATHS}.get(kind, _LLAMA_PATHS)


def _score(a: str, b: str) -> float:
    """A deterministic relevance in [0, 1): shared words, plus a hash for ties."""
    wa, wb = set(a.lower().split()), set(b.lower().split())
    overlap = len(wa & wb) / (len(wa | wb) or 1)
    jitter = int.from_bytes(hashlib.blake2b(f"{a}\0{b}".encode(), digest_size=2).digest())
    return round(0.9 * overlap + 0.1 * jitter / 65536, 6)


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


class MoreRoutes(Handlers):
    """The routes of this module over one engine."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.stored: dict[str, dict[str, Any]] = {}
        self.inputs: dict[str, list[dict[str, Any]]] = {}

    def table(self) -> tuple[dict[str, Route], dict[str, Route]]:
        """(GET routes, POST routes) this engine kind serves."""
        post: dict[str, Route] = {}
        handlers: dict[str, Route] = {
            "/v1/responses": self.responses,
            "/v1/messages": self.messages,
            "/v1/rerank": self.rerank,
            "/rerank": self.rerank,
            "/v2/rerank": self.rerank,
            "/reranking": self.rerank,
            "/v1/reranking": self.rerank,
            "/v1/score": self.score,
            "/score": self.score,
            "/pooling": self.pooling,
            "/classify": self.classify,
            "/v1/audio/transcriptions": self.audio,
            "/v1/audio/translations": self.audio,
        }
        for path in served_paths(self.kind):
            post[path] = handlers[path]
        get: dict[str, Route] = {}
        if self.kind in ("vllm", "sglang"):
            get["/openapi.json"] = self.openapi
        return get, post

    def stored_route(self, request: Request) -> Route | None:
        """GET/DELETE /v1/responses/{id}, POST .../cancel, GET .../input_items."""
        if "/v1/responses" not in served_paths(self.kind):
            return None
        if not request.path.startswith("/v1/responses/"):
            return None
        rest = request.path[len("/v1/responses/") :]
        rid, _, action = rest.partition("/")
        if not rid:
            return None
        if action == "" and request.method in ("GET", "HEAD"):
            return self.get_response
        if action == "" and request.method == "DELETE":
            return self.delete_response
        if action == "cancel" and request.method == "POST":
            return self.cancel_response
        if action == "input_items" and request.method == "GET":
            return self.input_items
        return None

    # ----- helpers ------------------------------------------------------------

    def _json(self, body: Any, request: Request, status: int = 200) -> Response:
        return Response(status, _enc(body), _JSON, self._echo(request))

    @staticmethod
    def _echo(request: Request) -> dict[str, str] | None:
        tp = request.headers.get("traceparent")
        return {"X-Sim-Traceparent": tp} if tp else None

    def _output(self, prompt: str, limit: Any) -> tuple[list[str], int]:
        """(output tokens, prompt token count) for a prompt."""
        count = limit if isinstance(limit, int) and 0 < limit <= _MAX_OUTPUT else _DEFAULT_OUTPUT
        tokens = greedy_tokens(prompt, count)
        n_in = len(tokenize(prompt, self.engine.token_cap))
        self.engine.stats.prompt_tokens += n_in
        self.engine.stats.generation_tokens += len(tokens)
        return tokens, n_in

    def _model(self, body: dict[str, Any]) -> str:
        model = body.get("model")
        return model if isinstance(model, str) else self.engine.config.primary_name

    def _begin(self, request: Request) -> dict[str, Any] | Response:
        body = self._body(request, inference=True)
        if isinstance(body, Response):
            return body
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            return self.engine.error(400, "`model` must be a string")
        bad = self.engine.check_model(model) or self.engine.injected_error(request)
        return bad if bad is not None else body

    # ----- /openapi.json ------------------------------------------------------

    async def openapi(self, request: Request) -> Response:
        paths: dict[str, Any] = {
            "/v1/chat/completions": {"post": {}},
            "/v1/completions": {"post": {}},
            "/v1/embeddings": {"post": {}},
            "/v1/models": {"get": {}},
            "/health": {"get": {}},
        }
        if self.kind == "vllm":
            paths["/tokenize"] = {"post": {}}
            paths["/detokenize"] = {"post": {}}
        for path in served_paths(self.kind):
            paths[path] = {"post": {}}
        if "/v1/responses" in served_paths(self.kind):
            paths["/v1/responses/{response_id}"] = {"get": {}, "delete": {}}
            paths["/v1/responses/{response_id}/cancel"] = {"post": {}}
        body = {"openapi": "3.1.0", "info": {"title": "FastAPI", "version": "0.1.0"}}
        return self._json({**body, "paths": paths}, request)

    # ----- /v1/responses ----------------------------------------------------------

    def _response_prompt(self, body: dict[str, Any]) -> str | Response:
        parts: list[str] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            stored = self.stored.get(previous) if isinstance(previous, str) else None
            if stored is None:
                return self.engine.error(404, f"Response with id '{previous}' not found.")
            parts.append(stored["_prompt"] + stored["output"][0]["content"][0]["text"])
        if isinstance(body.get("instructions"), str):
            parts.append(body["instructions"])
        given = body.get("input")
        if isinstance(given, str):
            parts.append(given)
        elif isinstance(given, list):
            parts.extend(_text_of(item.get("content")) for item in given if isinstance(item, dict))
        else:
            return self.engine.error(400, "`input` must be a string or a list of items")
        return " ".join(parts)

    async def responses(self, request: Request) -> Response | Stream:
        body = self._begin(request)
        if isinstance(body, Response):
            return body
        prompt = self._response_prompt(body)
        if isinstance(prompt, Response):
            return prompt
        tokens, n_in = self._output(prompt, body.get("max_output_tokens"))
        text, n_out = "".join(tokens), len(tokens)
        eng = self.engine
        rid = eng.new_id("resp_")
        response: dict[str, Any] = {
            "id": rid,
            "object": "response",
            "created_at": int(time.time()),
            "status": "completed",
            "model": self._model(body),
            "output": [
                {
                    "type": "message",
                    "id": eng.new_id("msg_"),
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}],
                }
            ],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "previous_response_id": body.get("previous_response_id"),
            "usage": {
                "input_tokens": n_in,
                "output_tokens": n_out,
                "total_tokens": n_in + n_out,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            },
        }
        if body.get("store", True):
            if len(self.stored) >= _MAX_STORED:
                oldest = next(iter(self.stored))
                del self.stored[oldest]
                self.inputs.pop(oldest, None)
            self.stored[rid] = {**response, "_prompt": prompt}
            given = body.get("input")
            self.inputs[rid] = (
                [{"type": "message", "role": "user", "content": given}]
                if isinstance(given, str)
                else [i for i in given or () if isinstance(i, dict)]
            )
        if not body.get("stream"):
            return self._json(response, request)
        return await self._stream_response(request, response, tokens)

    async def _stream_response(
        self, request: Request, response: dict[str, Any], tokens: list[str]
    ) -> Stream:
        text = "".join(tokens)
        stream = Stream(request)
        stream.prepare(200, {"Content-Type": _SSE, **(self._echo(request) or {})})
        seq = 0

        async def event(kind: str, data: dict[str, Any]) -> None:
            nonlocal seq
            payload = _enc({"type": kind, "sequence_number": seq, **data})
            seq += 1
            await stream.write(b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n")

        item = response["output"][0]
        begun = {**response, "status": "in_progress", "output": [], "usage": None}
        await event("response.created", {"response": begun})
        await event("response.in_progress", {"response": begun})
        await event(
            "response.output_item.added",
            {"output_index": 0, "item": {**item, "status": "in_progress", "content": []}},
        )
        part = {"type": "output_text", "text": "", "annotations": []}
        where = {"item_id": item["id"], "output_index": 0, "content_index": 0}
        await event("response.content_part.added", {**where, "part": part})
        for token in tokens:
            await event("response.output_text.delta", {**where, "delta": token, "logprobs": []})
            await asyncio.sleep(0)
        await event("response.output_text.done", {**where, "text": text, "logprobs": []})
        await event("response.content_part.done", {**where, "part": {**part, "text": text}})
        await event("response.output_item.done", {"output_index": 0, "item": item})
        await event("response.completed", {"response": response})
        await stream.write_eof()
        return stream

    async def get_response(self, request: Request) -> Response:
        gate = self._gate(request, inference=False)
        if gate is not None:
            return gate
        rid = request.path.split("/")[3]
        stored = self.stored.get(rid)
        if stored is None:
            return self.engine.error(404, f"Response with id '{rid}' not found.")
        return self._json(_public(stored), request)

    async def delete_response(self, request: Request) -> Response:
        gate = self._gate(request, inference=False)
        if gate is not None:
            return gate
        rid = request.path.split("/")[3]
        if self.stored.pop(rid, None) is None:
            return self.engine.error(404, f"Response with id '{rid}' not found.")
        self.inputs.pop(rid, None)
        return self._json({"id": rid, "object": "response.deleted", "deleted": True}, request)

    async def cancel_response(self, request: Request) -> Response:
        gate = self._gate(request, inference=False)
        if gate is not None:
            return gate
        rid = request.path.split("/")[3]
        stored = self.stored.get(rid)
        if stored is None:
            return self.engine.error(404, f"Response with id '{rid}' not found.")
        # Every simulated response is complete by the time it can be named.
        return self.engine.error(400, "Cannot cancel a response with status 'completed'.")

    async def input_items(self, request: Request) -> Response:
        gate = self._gate(request, inference=False)
        if gate is not None:
            return gate
        rid = request.path.split("/")[3]
        items = self.inputs.get(rid)
        if items is None:
            return self.engine.error(404, f"Response with id '{rid}' not found.")
        data = [{"id": f"{rid}_in{i}", **item} for i, item in enumerate(items)]
        # OpenAI's paging: `order` (asc or desc, by default desc in OpenAI's API; the
        # simulator kept asc before this took a query, and keeps it without one) and
        # `limit` (1-100).
        query = parse_qs(request.query)
        if query.get("order") == ["desc"]:
            data.reverse()
        has_more = False
        if "limit" in query:
            try:
                limit = int(query["limit"][0])
            except ValueError:
                limit = 0
            if not 1 <= limit <= 100:
                return self.engine.error(400, "limit: must be an integer from 1 to 100")
            has_more = len(data) > limit
            data = data[:limit]
        return self._json({"object": "list", "data": data, "has_more": has_more}, request)

    # ----- /v1/messages -------------------------------------------------------

    async def messages(self, request: Request) -> Response | Stream:
        body = self._begin(request)
        if isinstance(body, Response):
            return body
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return _anthropic_error(400, "messages: at least one message is required")
        if not isinstance(body.get("max_tokens"), int):
            return _anthropic_error(400, "max_tokens: Field required")
        prompt = " ".join(
            [_text_of(body.get("system"))]
            + [_text_of(m.get("content")) for m in messages if isinstance(m, dict)]
        )
        tokens, n_in = self._output(prompt, body["max_tokens"])
        text, n_out = "".join(tokens), len(tokens)
        eng = self.engine
        message = {
            "id": eng.new_id("msg_"),
            "type": "message",
            "role": "assistant",
            "model": self._model(body),
            "content": [{"type": "text", "text": text}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": n_in, "output_tokens": n_out},
        }
        if not body.get("stream"):
            return self._json(message, request)
        stream = Stream(request)
        stream.prepare(200, {"Content-Type": _SSE, **(self._echo(request) or {})})

        async def event(kind: str, data: dict[str, Any]) -> None:
            payload = _enc({"type": kind, **data})
            await stream.write(b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n")

        start = {**message, "content": [], "stop_reason": None}
        start["usage"] = {"input_tokens": n_in, "output_tokens": 0}
        await event("message_start", {"message": start})
        await event(
            "content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}
        )
        for token in tokens:
            await event(
                "content_block_delta",
                {"index": 0, "delta": {"type": "text_delta", "text": token}},
            )
            await asyncio.sleep(0)
        await event("content_block_stop", {"index": 0})
        await event(
            "message_delta",
            {
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": n_out},
            },
        )
        await event("message_stop", {})
        await stream.write_eof()
        return stream

    # ----- rerank, score, pooling, classify -----------------------------------

    async def rerank(self, request: Request) -> Response:
        body = self._begin(request)
        if isinstance(body, Response):
            return body
        query, documents = body.get("query"), body.get("documents")
        if not isinstance(query, str) or not isinstance(documents, list):
            return self.engine.error(
                400, "`query` (a string) and `documents` (a list) are required"
            )
        texts = [d if isinstance(d, str) else _text_of([d]) for d in documents]
        scores = [_score(query, t) for t in texts]
        order = sorted(range(len(texts)), key=lambda i: -scores[i])
        ranked = [
            {"index": i, "document": {"text": texts[i]}, "relevance_score": scores[i]}
            for i in order
        ]
        top_n = body.get("top_n")
        if isinstance(top_n, int) and top_n > 0:
            ranked = ranked[:top_n]
        tokens = sum(len(tokenize(query + " " + t)) for t in texts)
        return self._json(
            {
                "id": self.engine.new_id("rerank-"),
                "model": self._model(body),
                "usage": {"total_tokens": tokens},
                "results": ranked,
            },
            request,
        )

    async def score(self, request: Request) -> Response:
        body = self._begin(request)
        if isinstance(body, Response):
            return body
        a, b = body.get("text_1"), body.get("text_2")
        firsts = a if isinstance(a, list) else [a]
        seconds = b if isinstance(b, list) else [b]
        if not all(isinstance(x, str) for x in firsts + seconds):
            return self.engine.error(400, "`text_1` and `text_2` must be strings or lists of them")
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            return self.engine.error(400, "`text_1` and `text_2` must have the same length")
        data = [
            {"index": i, "object": "score", "score": _score(x, y)}
            for i, (x, y) in enumerate(zip(firsts, seconds, strict=True))
        ]
        return self._listed("score-", body, data, request)

    def _listed(
        self, prefix: str, body: dict[str, Any], data: list[dict[str, Any]], request: Request
    ) -> Response:
        """A list answer as vLLM's score, pooling and classify routes give it."""
        return self._json(
            {
                "id": self.engine.new_id(prefix),
                "object": "list",
                "created": int(time.time()),
                "model": self._model(body),
                "data": data,
                "usage": {"prompt_tokens": 0, "total_tokens": 0},
            },
            request,
        )

    def _inputs(self, body: dict[str, Any]) -> list[str] | None:
        given = body.get("input")
        items: list[Any] = given if isinstance(given, list) else [given]
        return (
            [x for x in items if isinstance(x, str)]
            if all(isinstance(x, str) for x in items)
            else None
        )

    async def pooling(self, request: Request) -> Response:
        body = self._begin(request)
        if isinstance(body, Response):
            return body
        items = self._inputs(body)
        if items is None:
            return self.engine.error(400, "`input` must be a string or a list of strings")
        data = [
            {"index": i, "object": "pooling", "data": [_score(x, "pool"), _score("pool", x)]}
            for i, x in enumerate(items)
        ]
        return self._listed("pool-", body, data, request)

    async def classify(self, request: Request) -> Response:
        body = self._begin(request)
        if isinstance(body, Response):
            return body
        items = self._inputs(body)
        if items is None:
            return self.engine.error(400, "`input` must be a string or a list of strings")
        data = []
        for i, x in enumerate(items):
            p = _score(x, "positive")
            probs = [round(1 - p, 6), p]
            data.append(
                {
                    "index": i,
                    "label": "positive" if p > 0.5 else "negative",
                    "probs": probs,
                    "num_classes": 2,
                }
            )
        return self._listed("classify-", body, data, request)

    # ----- audio ----------------------------------------------------------------

    async def audio(self, request: Request) -> Response:
        gate = self._gate(request, inference=True)
        if gate is not None:
            return gate
        ctype = request.headers.get("content-type", "")
        if not ctype.startswith("multipart/form-data") or "boundary=" not in ctype:
            return self.engine.error(400, "a multipart/form-data body is required")
        boundary = ctype.split("boundary=", 1)[1].split(";")[0].strip('"')
        fields: dict[str, bytes] = {}
        for part in request.body.split(b"--" + boundary.encode())[1:]:
            head, _, value = part.partition(b"\r\n\r\n")
            marker = b'name="'
            at = head.find(marker)
            if at >= 0:
                name = head[at + len(marker) : head.find(b'"', at + len(marker))]
                fields[name.decode()] = value[:-2] if value.endswith(b"\r\n") else value
        if "file" not in fields:
            return self.engine.error(400, "the form has no `file`")
        model = fields.get("model", b"").decode() or None
        bad = self.engine.check_model(model)
        if bad is not None:
            return bad
        audio = fields["file"]
        words = greedy_tokens(hashlib.sha256(audio).hexdigest(), 6)
        text = "".join(words).strip()
        if fields.get("response_format", b"json") == b"text":
            return Response(200, text.encode(), "text/plain; charset=utf-8", self._echo(request))
        return self._json({"text": text}, request)


def _public(stored: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in stored.items() if not k.startswith("_")}


def _anthropic_error(status: int, message: str) -> Response:
    body = {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
    return Response(status, _enc(body), _JSON)
