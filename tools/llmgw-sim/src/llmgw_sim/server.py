"""The simulated engine's HTTP API (on :mod:`httpserver`) over the pure model in :mod:`model`."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import math
import os
import random
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import msgspec

from llmgw_sim import kvevents, metrics
from llmgw_sim.config import EngineConfig, StartupError
from llmgw_sim.driver import StepDriver, Waiter
from llmgw_sim.httpserver import Request, Response, Stream
from llmgw_sim.knobs import FAILURE_TYPES
from llmgw_sim.model import (
    TOKEN_COUNT_CAP,
    BatchSlots,
    PrefixCache,
    Timing,
    Vocabulary,
    echo_tokens,
    generate_tokens,
    output_length,
    tokenize,
)
from llmgw_sim.protocol import (
    BadRequest,
    Generation,
    decode_body,
    parse_chat,
    parse_completion,
    parse_embedding,
    parse_tokenize,
)
from llmgw_sim.scheduler import Scheduler, SchedulerConfig, Seq, StepCosts, StepPlan, block_hashes

if TYPE_CHECKING:
    from llmgw_router.tokens import PromptTokenizer


class _Named(Protocol):
    @property
    def model(self) -> str | None: ...


_Req = TypeVar("_Req", bound=_Named)

ERROR_HEADER = "X-Sim-Error"
ERROR_MESSAGE_HEADER = "X-Sim-Error-Message"
STALL_HEADER = "X-Sim-Stall-After"
# Request header names arrive lower-cased.
_ERROR_KEY = ERROR_HEADER.lower()
_ERROR_MESSAGE_KEY = ERROR_MESSAGE_HEADER.lower()
_STALL_KEY = STALL_HEADER.lower()

_enc = msgspec.json.encode
_JSON = "application/json"

_VLLM_ERROR_TYPES = {
    400: "BadRequestError",
    401: "Unauthorized",
    404: "NotFoundError",
    429: "TooManyRequestsError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}
_LLAMA_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}


class Engine:
    """One simulated engine: scheduler, prefix cache, statistics, lifecycle state."""

    def __init__(self, config: EngineConfig, on_crash: Callable[[str], None]) -> None:
        self.config = config
        self.kind = config.kind
        knobs = config.knobs
        self.knobs = knobs
        self.timing = Timing(
            knobs.ttft,
            knobs.itl,
            knobs.prefill_per_token,
            knobs.ttft_std_dev,
            knobs.itl_std_dev,
            knobs.time_factor_under_load,
        )
        self._jitter_rng = random.Random(knobs.seed + 1)
        self.tokenizer = _load_tokenizer(config.tokenizer) if config.tokenizer else None
        kv = config.kv_tokens
        capacity_blocks = max(1, kv // config.block_size)
        self.cache = PrefixCache(config.block_size, capacity_blocks, enabled=config.prefix_caching)
        self.slots = BatchSlots(config.max_num_seqs)
        self.kv_tokens_in_use = 0
        self.driver: StepDriver | None = None
        # Set by the runner once loaded, when --kv-events-config asks for a ZMQ publisher.
        self.kv_publisher: kvevents.Publisher | None = None
        if knobs.scheduler == "step":
            sched = Scheduler(
                SchedulerConfig(
                    max_num_seqs=config.max_num_seqs,
                    max_num_batched_tokens=config.max_num_batched_tokens,
                    num_blocks=capacity_blocks,
                    block_size=config.block_size,
                    prefix_caching=config.prefix_caching,
                )
            )
            costs = StepCosts(knobs.prefill_rate, knobs.step_time, knobs.decode_seq_time)
            self.driver = StepDriver(sched, costs, on_step=self._on_step)
            bs = config.block_size
            self.stats = metrics.Stats(
                running=lambda: sched.num_running,
                waiting=lambda: sched.num_waiting,
                kv_usage=lambda: sched.cache.usage,
                kv_tokens=lambda: sched.cache.referenced * bs,
                prefix_queries=lambda: sched.prefix_queries,
                prefix_hits=lambda: sched.prefix_hits,
                preemptions=lambda: sched.preemptions,
            )
        else:
            self.stats = metrics.Stats(
                running=lambda: self.slots.running,
                waiting=lambda: self.slots.waiting,
                kv_usage=lambda: min(1.0, self.kv_tokens_in_use / kv),
                kv_tokens=lambda: self.kv_tokens_in_use,
                prefix_queries=lambda: self.cache.queries,
                prefix_hits=lambda: self.cache.hits,
            )
        self.stats.size_token_histograms(config.max_model_len)
        if config.lora_enabled:
            self.stats.lora_info = lambda: (
                config.max_loras,
                sorted(self.lora_running),
                sorted(self.lora_waiting),
            )
        self.stats.cache_info = {
            "block_size": str(config.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(config.prefix_caching),
            "gpu_memory_utilization": str(config.memory_fraction or 0.9),
            "num_gpu_blocks": str(capacity_blocks),
        }
        self.ready = False
        self.draining = False
        self.completed = 0
        self.created = int(time.time())
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self._next_rid = 0
        self._id_prefix = os.urandom(6).hex()
        self._rng = random.Random(knobs.seed)
        self._error_types = [t for t in knobs.error_types.split(",") if t]
        self.crash = on_crash
        self._names = set(config.served_names)
        self.loras: dict[str, str] = dict(config.lora_modules)
        # Requests per adapter, for vllm:lora_requests_info.
        self.lora_running: dict[str, int] = {}
        self.lora_waiting: dict[str, int] = {}
        self._auth = {f"Bearer {k}" for k in config.api_keys}
        self.vocab = Vocabulary()

    # ----- scheduling -------------------------------------------------------

    def _on_step(self, plan: StepPlan) -> None:
        self.stats.iteration_tokens.observe(plan.prefill_tokens + plan.decodes)
        self.stats.decode_steps += 1
        if self.driver is not None:
            cache = self.driver.scheduler.cache
            stored, removed = cache.drain_blocks()
            if self.kv_publisher is not None and (stored or removed):
                self.kv_publisher.publish(kvevents.events(stored, removed, self.config.block_size))

    @property
    def busy(self) -> int:
        """Requests running or waiting (what a graceful stop waits for)."""
        if self.driver is not None:
            sched = self.driver.scheduler
            return sched.num_running + sched.num_waiting
        return self.slots.running + self.slots.waiting

    async def acquire(self) -> int:
        self._next_rid += 1
        rid = self._next_rid
        if not self.slots.submit(rid):
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters[rid] = fut
            try:
                await fut
            except BaseException:
                self._waiters.pop(rid, None)
                self.release(rid)
                raise
        return rid

    def release(self, rid: int) -> None:
        for started in self.slots.release(rid):
            fut = self._waiters.pop(started, None)
            if fut is not None and not fut.done():
                fut.set_result(None)

    def _scale(self) -> float:
        return self.timing.load_scale(self.slots.running, self.slots.max_running)

    def prefill_delay(self, prompt_len: int, cached: int) -> float:
        t = self.timing
        base = t.jitter(t.ttft, t.ttft_std, self._jitter_rng)
        return (base + t.prefill_per_token * max(0, prompt_len - cached)) * self._scale()

    def token_delay(self) -> float:
        t = self.timing
        return t.jitter(t.itl, t.itl_std, self._jitter_rng) * self._scale()

    def decode_delay(self, count: int) -> float:
        if count <= 1 or self.timing.itl <= 0:
            return 0.0
        if self.timing.itl_std <= 0:
            return self.timing.decode_time(count) * self._scale()
        return sum(self.token_delay() for _ in range(count - 1))

    def finished(self, reason: str) -> None:
        self.stats.requests_ok[reason] = self.stats.requests_ok.get(reason, 0) + 1
        self.completed += 1

    def crash_due(self) -> bool:
        limit = self.knobs.crash_after_requests
        return limit is not None and self.completed >= limit

    # ----- request plumbing -------------------------------------------------

    def error(self, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
        if self.kind == "vllm":
            body: dict[str, Any] = {
                "error": {
                    "message": message,
                    "type": _VLLM_ERROR_TYPES.get(status, "InternalServerError"),
                    "param": None,
                    "code": status,
                }
            }
        elif self.kind == "sglang":
            body = {
                "object": "error",
                "message": message,
                "type": _VLLM_ERROR_TYPES.get(status, "InternalServerError"),
                "param": None,
                "code": status,
            }
        else:
            body = {
                "error": {
                    "code": status,
                    "message": message,
                    "type": _LLAMA_ERROR_TYPES.get(status, "server_error"),
                }
            }
        return Response(status=status, body=_enc(body), content_type=_JSON, headers=headers)

    def unauthorized(self) -> Response:
        if self.kind == "llama-server":
            return self.error(401, "Invalid API Key")
        return Response(status=401, body=b'{"error":"Unauthorized"}', content_type=_JSON)

    def authorized(self, request: Request) -> bool:
        if not self._auth:
            return True
        header = request.headers.get("authorization")
        if header in self._auth:
            return True
        # llama.cpp also takes the key in X-Api-Key.
        if self.kind == "llama-server":
            key = request.headers.get("x-api-key")
            return key is not None and f"Bearer {key}" in self._auth
        return False

    def loading_response(self) -> Response:
        if self.kind == "llama-server":
            return self.error(503, "Loading model")
        return self.error(503, "The server is still loading the model.")

    def check_model(self, model: str | None) -> Response | None:
        if (
            model is None
            or self.kind == "llama-server"
            or model in self._names
            or model in self.loras
        ):
            return None
        return self.error(404, f"The model `{model}` does not exist.")

    def injected_error(self, request: Request) -> Response | None:
        raw = request.headers.get(_ERROR_KEY)
        if raw is not None:
            kind = FAILURE_TYPES.get(raw.strip())
            if kind is not None:
                status, message = kind
            else:
                try:
                    status = int(raw)
                except ValueError:
                    names = ", ".join(FAILURE_TYPES)
                    return self.error(
                        400,
                        f"{ERROR_HEADER} must be an HTTP status or one of {names}, got {raw!r}",
                    )
                if not 400 <= status <= 599:
                    return self.error(
                        400, f"{ERROR_HEADER} must be between 400 and 599, got {status}"
                    )
                message = f"Simulated error {status}"
            return self.error(status, request.headers.get(_ERROR_MESSAGE_KEY, message))
        if self.knobs.error_rate and self._rng.random() < self.knobs.error_rate:
            if self._error_types:
                status, message = FAILURE_TYPES[self._rng.choice(self._error_types)]
            else:
                status = self.knobs.error_status
                message = f"Simulated error {status} (--sim-error-rate)"
            return self.error(status, message)
        return None

    @property
    def token_cap(self) -> int:
        """How far prompts are tokenized: past --max-model-len, never without bound."""
        return max(TOKEN_COUNT_CAP, self.config.max_model_len + 1)

    def context_error(
        self, gen: Generation, prompt_len: int, *, at_least: bool = False
    ) -> Response | None:
        """400 when the prompt (plus max_tokens) does not fit, worded as each engine words it.

        ``at_least``: tokenizing stopped at :attr:`token_cap`, the prompt has more tokens."""
        limit = self.config.max_model_len
        more = "at least " if at_least else ""
        too_long = prompt_len >= limit
        over = gen.max_tokens is not None and prompt_len + gen.max_tokens > limit
        if self.kind == "llama-server":
            # llama.cpp rejects only prompts that do not fit; generation stops at the
            # context's end instead ("length").
            if not too_long:
                return None
            body = {
                "error": {
                    "code": 400,
                    "message": "the request exceeds the available context size, try increasing it",
                    "type": "exceed_context_size_error",
                    "n_prompt_tokens": prompt_len,
                    "n_ctx": limit,
                }
            }
            return Response(status=400, body=_enc(body), content_type=_JSON)
        if self.kind == "sglang":
            if too_long:
                return self.error(
                    400,
                    f"The input ({more}{prompt_len} tokens) is longer than the model's context "
                    f"length ({limit} tokens).",
                )
            if over:
                return self.error(
                    400,
                    "Requested token count exceeds the model's maximum context length of "
                    f"{limit} tokens. You requested a total of {prompt_len + (gen.max_tokens or 0)} "
                    f"tokens: {prompt_len} tokens from the input messages and {gen.max_tokens} "
                    "tokens for the completion. Please reduce the number of tokens in the input "
                    "messages or the completion to fit within the limit.",
                )
            return None
        if too_long:
            return self.error(
                400,
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {more}{prompt_len} input tokens. Please reduce the length of the input "
                "messages.",
            )
        if over:
            return self.error(
                400,
                f"'max_tokens' or 'max_completion_tokens' is too large: {gen.max_tokens}. "
                f"This model's maximum context length is {limit} tokens and your request has "
                f"{prompt_len} input tokens ({gen.max_tokens} > {limit} - {prompt_len}).",
            )
        return None

    def new_id(self, prefix: str) -> str:
        self._next_rid += 1
        return f"{prefix}{self._id_prefix}{self._next_rid:010x}"


class Api:
    """HTTP handlers; one instance per engine process."""

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

    # ----- small endpoints --------------------------------------------------

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

    async def version(self, request: Request) -> Response:
        return Response(body=_enc({"version": self.engine.config.version}), content_type=_JSON)

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

    async def model_info(self, request: Request) -> Response:
        cfg = self.engine.config
        return Response(
            body=_enc(
                {
                    "model_path": cfg.model,
                    "tokenizer_path": cfg.model,
                    "is_generation": True,
                    "preferred_sampling_params": None,
                }
            ),
            content_type=_JSON,
        )

    async def server_info(self, request: Request) -> Response:
        cfg = self.engine.config
        info: dict[str, Any] = {
            "model_path": cfg.model,
            "served_model_name": cfg.primary_name,
            "tp_size": cfg.tp,
            "dp_size": cfg.dp,
            "context_length": cfg.max_model_len,
            "max_running_requests": cfg.max_num_seqs,
            "port": cfg.port,
            "host": cfg.host,
            "version": cfg.version,
        }
        return Response(body=_enc(info), content_type=_JSON)

    async def props(self, request: Request) -> Response:
        if not self.engine.ready:
            return self.engine.loading_response()
        cfg = self.engine.config
        body = {
            "default_generation_settings": {"n_ctx": cfg.max_model_len, "params": {}},
            "total_slots": cfg.max_num_seqs,
            "model_path": cfg.model,
            "model_alias": cfg.primary_name,
            "build_info": f"b{cfg.version.lstrip('b')}-llmgwsim",
            "chat_template": "",
        }
        return Response(body=_enc(body), content_type=_JSON)

    # ----- vLLM's runtime LoRA endpoints ------------------------------------

    async def load_lora(self, request: Request) -> Response:
        eng = self.engine
        body = self._body(request, inference=False)
        if isinstance(body, Response):
            return body
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return eng.error(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name in eng.loras:
            return eng.error(400, f"The lora adapter '{name}' has already been loaded.")
        eng.loras[name] = path
        return Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(self, request: Request) -> Response:
        eng = self.engine
        body = self._body(request, inference=False)
        if isinstance(body, Response):
            return body
        name = body.get("lora_name")
        if not isinstance(name, str) or name not in eng.loras:
            return eng.error(404, f"The lora adapter '{name}' cannot be found.")
        del eng.loras[name]
        return Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    # ----- vLLM's tokenizer endpoints ---------------------------------------

    # Outside /v1, so vLLM's --api-key does not cover them.
    async def tokenize(self, request: Request) -> Response:
        eng = self.engine
        try:
            model, prompt = parse_tokenize(decode_body(request.body))
        except BadRequest as err:
            return eng.error(400, str(err))
        bad = eng.check_model(model)
        if bad is not None:
            return bad
        ids = (
            prompt
            if isinstance(prompt, list)
            else eng.vocab.encode(tokenize(prompt, eng.token_cap))
        )
        body = {
            "count": len(ids),
            "max_model_len": eng.config.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }
        return Response(body=_enc(body), content_type=_JSON)

    async def detokenize(self, request: Request) -> Response:
        eng = self.engine
        try:
            body = decode_body(request.body)
        except BadRequest as err:
            return eng.error(400, str(err))
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            return eng.error(400, "'tokens' must be a list of token ids")
        return Response(body=_enc({"prompt": eng.vocab.decode(ids)}), content_type=_JSON)

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

    # ----- generation -------------------------------------------------------

    async def chat(self, request: Request) -> Response | Stream:
        return await self._generate(request, self._parse_chat)

    async def completions(self, request: Request) -> Response | Stream:
        return await self._generate(request, self._parse_completion)

    def _parse_chat(self, body: dict[str, Any]) -> Generation:
        gen = parse_chat(body)
        tokenizer = self.engine.tokenizer
        if tokenizer is not None:
            ids = tokenizer.chat(body.get("messages"))
            if ids:
                gen = dataclasses.replace(gen, prompt_ids=ids)
        return gen

    def _parse_completion(self, body: dict[str, Any]) -> Generation:
        gen = parse_completion(body)
        tokenizer = self.engine.tokenizer
        if tokenizer is not None and gen.prompt_ids is None:
            ids = tokenizer.completion(gen.prompt_text)
            if ids:
                gen = dataclasses.replace(gen, prompt_ids=ids)
        return gen

    async def _generate(
        self, request: Request, parse: Callable[[dict[str, Any]], Generation]
    ) -> Response | Stream:
        eng = self.engine
        arrival = time.monotonic()
        gen = self._admit(request, parse)
        if isinstance(gen, Response):
            return gen
        cap = eng.token_cap
        prompt: list[Any] = (
            gen.prompt_ids if gen.prompt_ids is not None else tokenize(gen.prompt_text, cap)
        )
        prompt_len = len(prompt)
        bad = eng.context_error(gen, prompt_len, at_least=prompt_len >= cap)
        if bad is not None:
            return bad
        stall_after = eng.knobs.stall_after_tokens
        stall_raw = request.headers.get(_STALL_KEY)
        if stall_raw is not None:
            try:
                stall_after = int(stall_raw)
            except ValueError:
                return eng.error(400, f"{STALL_HEADER} must be an integer, got {stall_raw!r}")
        knobs = eng.knobs
        count, finish = output_length(
            requested_max=gen.max_tokens,
            sim_output_len=knobs.output_len,
            default_max_tokens=knobs.default_max_tokens,
            prompt_tokens=prompt_len,
            max_model_len=eng.config.max_model_len,
            ignore_eos=gen.ignore_eos,
        )
        if knobs.mode == "echo":
            out_tokens = echo_tokens([str(t) for t in prompt], count)
        else:
            out_tokens = generate_tokens(count, knobs.seed + prompt_len)

        if eng.driver is not None:
            return await self._generate_stepped(
                request, gen, prompt, out_tokens, finish, stall_after, arrival
            )
        lora = gen.model if gen.model in eng.loras else None
        if lora is not None:
            _bump(eng.lora_waiting, lora, 1)
        try:
            rid = await eng.acquire()
        finally:
            if lora is not None:
                _bump(eng.lora_waiting, lora, -1)
        if lora is not None:
            _bump(eng.lora_running, lora, 1)
        started = time.monotonic()
        kv_held = prompt_len
        eng.kv_tokens_in_use += kv_held
        stats = eng.stats
        try:
            cached, hashes = eng.cache.lookup(prompt)
            delay = eng.prefill_delay(prompt_len, cached)
            if delay > 0:
                await asyncio.sleep(delay)
            eng.cache.insert(hashes)
            first_token_at = time.monotonic()
            self._observe_first(arrival, started, first_token_at, prompt_len)
            eng.kv_tokens_in_use += count
            kv_held += count
            headers = self._id_headers(request)
            if gen.stream:
                resp = await self._stream(
                    request, gen, out_tokens, finish, prompt_len, stall_after, headers
                )
            else:
                decode = eng.decode_delay(count)
                if decode > 0:
                    await asyncio.sleep(decode)
                resp = self._full(gen, out_tokens, finish, prompt_len, headers)
            stats.decode_steps += count
            self._observe(gen, arrival, started, first_token_at, prompt_len, count)
            eng.finished(finish)
        except asyncio.CancelledError:
            # The client went away (or shutdown ran out of grace).
            eng.stats.requests_ok["abort"] += 1
            raise
        finally:
            eng.kv_tokens_in_use -= kv_held
            eng.release(rid)
            if lora is not None:
                _bump(eng.lora_running, lora, -1)
        self._crash_if_due(request, resp)
        return resp

    def _crash_if_due(self, request: Request, resp: Response | Stream) -> None:
        eng = self.engine
        if eng.crash_due():
            # Deliver this response completely, then die as the engine would.
            if isinstance(resp, Response):
                conn = request.conn
                head = conn.server.head(resp.status, resp.headers, len(resp.body), False)
                conn.write(head + resp.body)
            eng.crash(f"after {eng.completed} requests")

    def _id_headers(self, request: Request) -> dict[str, str] | None:
        if not self.engine.config.request_id_headers:
            return None
        return {"X-Request-Id": request.headers.get("x-request-id") or self.engine.new_id("")}

    def _observe_first(
        self, arrival: float, started: float, first_token_at: float, prompt_len: int
    ) -> None:
        stats = self.engine.stats
        stats.ttft.observe(first_token_at - arrival)
        stats.prompt_tokens += prompt_len
        stats.prompt_seconds += first_token_at - started

    def _observe(
        self,
        gen: Generation,
        arrival: float,
        started: float,
        first_token_at: float,
        prompt_len: int,
        count: int,
    ) -> None:
        stats = self.engine.stats
        done = time.monotonic()
        stats.generation_tokens += count
        stats.decode_seconds += done - first_token_at
        if count > 1:
            per_token = (done - first_token_at) / (count - 1)
            stats.itl.observe_many(per_token, count - 1)
            stats.tpot.observe(per_token)
        stats.e2e.observe(done - arrival)
        stats.queue_time.observe(started - arrival)
        stats.prefill_time.observe(first_token_at - started)
        stats.decode_time.observe(done - first_token_at)
        stats.inference_time.observe(done - started)
        stats.prompt_len.observe(prompt_len)
        stats.gen_len.observe(count)
        if gen.max_tokens is not None:
            stats.max_tokens_param.observe(gen.max_tokens)

    async def _generate_stepped(
        self,
        request: Request,
        gen: Generation,
        prompt: list[Any],
        out_tokens: list[str],
        finish: str,
        stall_after: int | None,
        arrival: float,
    ) -> Response | Stream:
        """The step scheduler's path: queue in the engine, wait for its steps."""
        eng = self.engine
        driver = eng.driver
        assert driver is not None
        sched = driver.scheduler
        prompt_len, count = len(prompt), len(out_tokens)
        if not sched.fits(prompt_len, count):
            cfg = eng.config
            return eng.error(
                400,
                f"The request needs {prompt_len + count} tokens of KV cache; the cache holds "
                f"{sched.config.num_blocks * cfg.block_size} tokens.",
            )
        eng._next_rid += 1
        rid = eng._next_rid
        hashes = (
            block_hashes([str(t) for t in prompt], eng.config.block_size)
            if eng.config.prefix_caching
            else []
        )
        ids = gen.prompt_ids if eng.tokenizer is not None else None
        waiter = driver.submit(
            Seq(rid, prompt_len, count, hashes, token_ids=ids), stream=gen.stream
        )
        try:
            while waiter.first_at is None and not waiter.done:
                waiter.event.clear()
                await waiter.event.wait()
            first_token_at = waiter.first_at or time.monotonic()
            started = waiter.admitted_at or first_token_at
            self._observe_first(arrival, started, first_token_at, prompt_len)
            headers = self._id_headers(request)
            resp: Response | Stream
            if gen.stream:
                resp = await self._stream(
                    request, gen, out_tokens, finish, prompt_len, stall_after, headers, waiter
                )
            else:
                while not waiter.done:
                    waiter.event.clear()
                    await waiter.event.wait()
                resp = self._full(gen, out_tokens, finish, prompt_len, headers)
            self._observe(gen, arrival, started, first_token_at, prompt_len, count)
            eng.finished(finish)
        except asyncio.CancelledError:
            eng.stats.requests_ok["abort"] += 1
            raise
        finally:
            driver.abort(rid)  # frees its blocks when it did not finish (client gone)
        self._crash_if_due(request, resp)
        return resp

    def _full(
        self,
        gen: Generation,
        tokens: list[str],
        finish: str,
        prompt_len: int,
        headers: dict[str, str] | None,
    ) -> Response:
        eng = self.engine
        text = "".join(tokens)
        usage = {
            "prompt_tokens": prompt_len,
            "total_tokens": prompt_len + len(tokens),
            "completion_tokens": len(tokens),
            "prompt_tokens_details": None,
        }
        created = int(time.time())
        body: dict[str, Any]
        if gen.endpoint == "chat":
            body = {
                "id": eng.new_id("chatcmpl-"),
                "object": "chat.completion",
                "created": created,
                "model": gen.model or eng.config.primary_name,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": text,
                            "refusal": None,
                            "annotations": None,
                            "audio": None,
                            "function_call": None,
                            "tool_calls": [],
                            "reasoning_content": None,
                        },
                        "logprobs": None,
                        "finish_reason": finish,
                        "stop_reason": None,
                    }
                ],
                "service_tier": None,
                "system_fingerprint": None,
                "usage": usage,
                "prompt_logprobs": None,
                "kv_transfer_params": None,
            }
        else:
            body = {
                "id": eng.new_id("cmpl-"),
                "object": "text_completion",
                "created": created,
                "model": gen.model or eng.config.primary_name,
                "choices": [
                    {
                        "index": 0,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": finish,
                        "stop_reason": None,
                        "prompt_logprobs": None,
                    }
                ],
                "service_tier": None,
                "system_fingerprint": None,
                "usage": usage,
                "kv_transfer_params": None,
            }
        return Response(body=_enc(body), content_type=_JSON, headers=headers)

    async def _stream(
        self,
        request: Request,
        gen: Generation,
        tokens: list[str],
        finish: str,
        prompt_len: int,
        stall_after: int | None,
        headers: dict[str, str] | None,
        waiter: Waiter | None = None,
    ) -> Response | Stream:
        """Write the SSE stream: paced by --sim-itl, or by the engine's steps (``waiter``)."""
        eng = self.engine
        chat = gen.endpoint == "chat"
        rid = eng.new_id("chatcmpl-" if chat else "cmpl-")
        model = _enc(gen.model or eng.config.primary_name)
        created = int(time.time())
        obj = b"chat.completion.chunk" if chat else b"text_completion"
        head = b'data: {"id":"%s","object":"%s","created":%d,"model":%s,"choices":[' % (
            rid.encode(),
            obj,
            created,
            model,
        )
        if chat:
            open_ = head + b'{"index":0,"delta":{"content":'
            mid = b'},"logprobs":null,"finish_reason":null}]}\n\n'
            end = (
                b'},"logprobs":null,"finish_reason":"%s","stop_reason":null}]}\n\n'
                % finish.encode()
            )
        else:
            open_ = head + b'{"index":0,"text":'
            mid = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
            end = (
                b',"logprobs":null,"finish_reason":"%s","stop_reason":null}]}\n\n' % finish.encode()
            )

        # vLLM adds running usage to every chunk only with both stream options.
        continuous = gen.include_usage and gen.continuous_usage
        n = len(tokens)
        itl = eng.timing.itl
        limit = n if stall_after is None else min(n, max(0, stall_after))
        chunked = bool(n and (itl > 0 or waiter is not None or limit < n or continuous))
        # A stream written in one piece may send its headers with the body (one
        # write instead of two); a paced one shows its headers at once.
        resp = Stream(request)
        resp.prepare(
            200,
            {
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                **(headers or {}),
            },
            send_now=chunked,
        )

        def with_usage(chunk: bytes, done: int) -> bytes:
            if not continuous:
                return chunk
            usage = b'"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}' % (
                prompt_len,
                prompt_len + done,
                done,
            )
            return chunk[:-3] + b"," + usage + b"}\n\n"

        parts: list[bytes] = []
        if chat:
            parts.append(
                with_usage(
                    head + b'{"index":0,"delta":{"role":"assistant","content":""},'
                    b'"logprobs":null,"finish_reason":null}]}\n\n',
                    0,
                )
            )
        encoded = [_token_json(t) for t in tokens] or [b'""']
        if chunked:
            # Paced, stalling or per-chunk usage: chunk by chunk.
            for i in range(limit):
                parts.append(with_usage(open_ + encoded[i] + (end if i == n - 1 else mid), i + 1))
                if waiter is not None:
                    if i < n - 1 and waiter.tokens <= i + 1:
                        # Everything sampled so far goes out in one write; then wait a step.
                        await resp.write(b"".join(parts))
                        parts.clear()
                        while waiter.tokens <= i + 1 and not waiter.done:
                            waiter.event.clear()
                            await waiter.event.wait()
                elif itl > 0:
                    await resp.write(b"".join(parts))
                    parts.clear()
                    if i < n - 1:
                        await asyncio.sleep(eng.token_delay())
            if limit < n:
                if parts:
                    await resp.write(b"".join(parts))
                # Stalled: the connection stays open and silent until the client
                # gives up or shutdown cancels us.
                await asyncio.Event().wait()
        else:
            # No pacing: every event at once, built by one C-level join.
            parts.append(with_usage(open_ + (mid + open_).join(encoded) + end, n))
        if gen.include_usage:
            parts.append(
                head[: -len(b'"choices":[')]
                + b'"choices":[],"usage":{"prompt_tokens":%d,"total_tokens":%d,'
                b'"completion_tokens":%d}}\n\n' % (prompt_len, prompt_len + n, n)
            )
        parts.append(b"data: [DONE]\n\n")
        await resp.write_eof(b"".join(parts))
        return resp


def _bump(counts: dict[str, int], key: str, delta: int) -> None:
    value = counts.get(key, 0) + delta
    if value > 0:
        counts[key] = value
    else:
        counts.pop(key, None)


_TOKEN_JSON: dict[str, bytes] = {}


def _token_json(token: str) -> bytes:
    """JSON for a token, cached: generated text reuses a small vocabulary."""
    cached = _TOKEN_JSON.get(token)
    if cached is None:
        cached = _enc(token)
        if len(_TOKEN_JSON) < 65536:
            _TOKEN_JSON[token] = cached
    return cached


def _embedding(item: str | list[int], dim: int) -> list[float]:
    """A deterministic unit vector derived from the input."""
    # A stable digest (not hash()) so every process gives the same vector.
    raw = item.encode() if isinstance(item, str) else b",".join(b"%d" % t for t in item)
    rng = random.Random(hashlib.blake2b(raw, digest_size=8).digest())
    vec = [rng.uniform(-1.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [v / norm for v in vec]


Route = Callable[[Request], Awaitable["Response | Stream"]]


def build_app(engine: Engine, *, health_only: bool = False) -> Route:
    """The engine's routes as one request handler for :class:`HttpServer`."""
    api = Api(engine)
    get: dict[str, Route] = {"/health": api.health}
    post: dict[str, Route] = {}
    if engine.kind == "sglang":
        get["/health_generate"] = api.health
    if not health_only:
        get["/metrics"] = api.metrics
        get["/v1/models"] = api.models
        post["/v1/chat/completions"] = api.chat
        post["/v1/completions"] = api.completions
        post["/v1/embeddings"] = api.embeddings
        if engine.kind in ("vllm", "sglang"):
            get["/version"] = api.version
        if engine.kind == "vllm" and engine.config.runtime_lora_updating:
            post["/v1/load_lora_adapter"] = api.load_lora
            post["/v1/unload_lora_adapter"] = api.unload_lora
        if engine.kind == "vllm":
            post["/tokenize"] = api.tokenize
            post["/detokenize"] = api.detokenize
        if engine.kind == "sglang":
            get["/get_model_info"] = api.model_info
            get["/get_server_info"] = api.server_info
        if engine.kind == "llama-server":
            get["/v1/health"] = api.health
            get["/models"] = api.models
            get["/props"] = api.props
            post["/chat/completions"] = api.chat
            post["/completions"] = api.completions
            post["/embeddings"] = api.embeddings
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


def _load_tokenizer(folder: str) -> PromptTokenizer:
    """--tokenizer's folder, rendered and encoded as llmgw-router does (its `precise` extra)."""
    try:
        from llmgw_router.tokens import PromptTokenizer, TokenizerError
    except ImportError:
        raise StartupError(
            "ImportError", "--tokenizer needs llmgw-router[precise] installed"
        ) from None
    try:
        return PromptTokenizer(Path(folder))
    except TokenizerError as err:
        raise StartupError("OSError", f"--tokenizer {folder}: {err}") from None
