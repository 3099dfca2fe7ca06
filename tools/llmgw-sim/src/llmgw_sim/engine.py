"""One simulated engine's state: scheduler, prefix cache, statistics, lifecycle, and how
each engine kind words its errors (auth, loading, unknown model, context, injected failures)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from llmgw_proto.prompts import PromptEncoder, TokenizerError

from llmgw_sim import bootstrap, kvevents, metrics
from llmgw_sim.config import EngineConfig, StartupError
from llmgw_sim.driver import StepDriver
from llmgw_sim.httpserver import Request, Response
from llmgw_sim.knobs import FAILURE_TYPES
from llmgw_sim.model import TOKEN_COUNT_CAP, BatchSlots, PrefixCache, Timing, Vocabulary
from llmgw_sim.protocol import Generation
from llmgw_sim.scheduler import Scheduler, SchedulerConfig, StepCosts, StepPlan

ERROR_HEADER = "X-Sim-Error"
ERROR_MESSAGE_HEADER = "X-Sim-Error-Message"
# Request header names arrive lower-cased.
_ERROR_KEY = ERROR_HEADER.lower()
_ERROR_MESSAGE_KEY = ERROR_MESSAGE_HEADER.lower()

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
                    max_loras=config.max_loras if config.lora_enabled else 0,
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
        # Disaggregated prefill (llmgw_sim.kvtransfer): transfers issued as a prefill
        # engine, received as a decode engine, and refused (not issued by a prefill engine).
        self.kv_counts: dict[str, int] = {"kv_issued": 0, "kv_received": 0, "kv_refused": 0}
        # SGLang's disaggregation (llmgw_sim.bootstrap): a prefill engine's rooms and
        # its bootstrap server.
        self.rooms = bootstrap.Rooms()
        self.bootstrap_server: asyncio.Server | None = None
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
        # llama-server serves one model whatever a request names, and so do SGLang's
        # OpenAI routes (a `model` of "base:adapter" names an adapter: adapter_for).
        if (
            model is None
            or self.kind in ("llama-server", "sglang")
            or model in self._names
            or model in self.loras
        ):
            return None
        return self.error(404, f"The model `{model}` does not exist.")

    def adapter_for(self, model: str | None, lora_path: object) -> str | Response | None:
        """The LoRA adapter a generation request names, as the engine reads it (None: the
        base model). vLLM: the adapter is the model (check_model refused any other name).
        SGLang: the adapter after the ':' of a model "base:adapter", else the body's
        ``lora_path``; one not loaded is refused as SGLang refuses it."""
        if self.kind != "sglang":
            return model if model is not None and model in self.loras else None
        name = model.split(":", 1)[1].strip() if model and ":" in model else ""
        if not name and isinstance(lora_path, str):
            name = lora_path
        if not name:
            return None
        if name not in self.loras:
            return self.error(
                400,
                f"The following requested LoRA adapters are not loaded: {name}\n"
                f"Loaded adapters: {self.loras.keys()}.",
            )
        return name

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


def _load_tokenizer(folder: str) -> PromptEncoder:
    """--tokenizer's folder, rendered and encoded as vLLM does (llmgw-proto's `precise` extra)."""
    missing = [name for name in ("tokenizers", "jinja2") if importlib.util.find_spec(name) is None]
    if missing:
        raise StartupError(
            "ImportError",
            f"--tokenizer needs {' and '.join(missing)}: pip install 'llmgw-proto[precise]'",
        )
    try:
        return PromptEncoder(Path(folder))
    except TokenizerError as err:
        raise StartupError("OSError", f"--tokenizer {folder}: {err}") from None
