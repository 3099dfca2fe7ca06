"""The two-phase exchange of a disaggregated model (issue 32): prefill, then decode.

A model whose endpoints have roles (``EndpointSpec.role``, from the control plane's
snapshot or a static endpoint's ``role``) is served in two phases, per engine family, as
the engines' own proxies do it:

- vLLM (its NIXL integration's proxy): the request goes to a prefill engine with
  ``kv_transfer_params: {do_remote_decode: true, do_remote_prefill: false, remote_*: null}``,
  ``max_tokens`` (and ``max_completion_tokens``) 1, ``stream`` false, no
  ``stream_options``; the ``kv_transfer_params`` of its answer are added to the original
  request, which goes to a decode engine and is relayed (streamed or not) to the client.
- SGLang (its load balancer's protocol): ``bootstrap_host`` (the prefill engine's host),
  ``bootstrap_port`` (its bootstrap port: the endpoint's ``kv_port``) and a random
  ``bootstrap_room`` are added; the request goes to the prefill and the decode engine at
  once, and the decode engine's answer is the client's.

The prefill engine is chosen by the router's balancer (prefix affinity and load) among
the prefill endpoints; the decode engine by the exchange's usual pick among the decode
endpoints (a retry stays among endpoints of the first pick's role: proxy/choose.py). :meth:`Phases.before` runs before every decode attempt, so a decode failure
before the first byte retries the pair (a fresh prefill), and a resumed stream
(proxy/resume.py) prefills its continuation. A prefill failure is counted against its
engine and the next prefill endpoint is tried, each at most ``PREFILL_ROUNDS`` (2) times;
when none answers, the attempt fails with reason ``prefill`` (not counted against the
decode engine).

Short prompts (``disagg.min_prompt_tokens``, vLLM family only): a request whose prompt is
estimated (body bytes / 4) under it goes to a decode engine alone, which prefills it
itself (a vLLM engine with a KV connector serves a request without
``kv_transfer_params`` as any engine does); SGLang's decode engines take only
transferred requests. Metrics: ``llmgw_router_disagg_phase_seconds{phase}`` (prefill,
transfer: the decode request to its first byte, decode: first byte to the end),
``llmgw_router_disagg_pairs_total{prefill,decode}``,
``llmgw_router_disagg_prefill_retries_total``, ``llmgw_router_disagg_local_total``; the
log line ``disaggregated request`` names both engines and each phase's time.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Sequence
from typing import Any

import structlog

from llmgw_router.endpoints import Endpoint
from llmgw_router.lora import sglang_adapter
from llmgw_router.proxy.context import RequestContext, UpstreamFailure
from llmgw_router.state import RouterState, now
from llmgw_router.upstream import Pool

__all__ = [
    "PHASED_PATHS",
    "Phases",
    "decode_params",
    "local",
    "sglang_body",
    "split",
    "vllm_decode_body",
    "vllm_prefill_body",
]

log = structlog.get_logger(__name__)

PHASED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
# How many times over each prefill endpoint may be tried for one decode attempt.
PREFILL_ROUNDS = 2
# Prompt bytes per token, to estimate a prompt's length from its body.
BYTES_PER_TOKEN = 4
# The params vLLM's proxy asks a prefill engine for (toy_proxy_server's shape).
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def split(candidates: Sequence[Endpoint]) -> tuple[list[Endpoint], list[Endpoint]] | None:
    """(prefill, decode) endpoints when the candidates have roles; None when none has."""
    prefill = [ep for ep in candidates if ep.spec.role == "prefill"]
    decode = [ep for ep in candidates if ep.spec.role == "decode"]
    if not prefill and not decode:
        return None
    return prefill, decode


def local(body_bytes: int, engine: str, min_prompt_tokens: int) -> bool:
    """Whether a request goes to a decode engine alone (its prompt is short enough)."""
    if engine == "sglang" or min_prompt_tokens <= 0:
        return False
    return body_bytes // BYTES_PER_TOKEN < min_prompt_tokens


def vllm_prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request a prefill engine gets: one token, not streamed, remote decode asked."""
    out = dict(body)
    out["kv_transfer_params"] = dict(REMOTE_DECODE)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    return out


def vllm_decode_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The original request with the prefill engine's ``kv_transfer_params``."""
    return {**body, "kv_transfer_params": params}


def decode_params(payload: bytes) -> dict[str, Any] | str:
    """The ``kv_transfer_params`` of a prefill engine's answer, or why there are none."""
    try:
        answer = json.loads(payload)
    except ValueError:
        return "the prefill engine's answer is not JSON"
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not isinstance(params, dict):
        return "the prefill engine's answer has no kv_transfer_params (is its KV connector on?)"
    return params


def sglang_body(body: dict[str, Any], host: str, port: int, room: int) -> dict[str, Any]:
    """The request both engines get: the prefill engine's bootstrap server and a room."""
    return {**body, "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}


def _host(url: str) -> str:
    rest = url.split("://", 1)[-1].split("/", 1)[0]
    if rest.startswith("["):
        return rest[1 : rest.index("]")]
    return rest.rsplit(":", 1)[0]


class Phases:
    """One request's prefill phases, before each of its decode attempts."""

    __slots__ = (
        "_failed",
        "_pool",
        "_sglang_failed",
        "_state",
        "_tasks",
        "decode_sent",
        "prefill",
        "prefill_id",
        "seconds",
    )

    def __init__(self, state: RouterState, pool: Pool, prefill: list[Endpoint]) -> None:
        self._state = state
        self._pool = pool
        self.prefill = prefill
        self._tasks: set[asyncio.Task[None]] = set()
        self.seconds = 0.0
        # The last pair's prefill endpoint and when its decode request went out.
        self.prefill_id = ""
        self.decode_sent = 0.0
        # SGLang: prefill endpoints whose prefill failed (the next pair avoids them while
        # another is left), and whether the current pair's did.
        self._failed: set[str] = set()
        self._sglang_failed = ""

    def _pick(self, ctx: RequestContext, exclude: set[str]) -> Endpoint | None:
        state = self._state
        tier = [ep for ep in self.prefill if ep.id not in exclude]
        if not tier:
            return None
        at = now()
        usable = state.usable_among(tier, at)
        tokens = ctx.tokens
        cached = (
            (lambda ep: tokens.cached(ep.token_blocks, ep.token_block_size))
            if tokens is not None
            else None
        )
        choice = state.balancer.choose(tier, usable, ctx.affinity_key, ctx.prefix, cached, at=at)
        if choice.endpoint is not None:
            choice.endpoint.sent(at)
        return choice.endpoint

    async def before(self, ctx: RequestContext, decode: Endpoint) -> None:
        """Prefill for the decode attempt at ``decode``: ``ctx.body`` becomes its request.

        Raises UpstreamFailure("prefill", ...) when no prefill engine answered.
        """
        try:
            body = json.loads(ctx.body)
        except ValueError:
            return  # not JSON: the decode engine answers it (400) as it would
        if not isinstance(body, dict):
            return
        metrics = self._state.metrics
        tried: set[str] = set(self._failed)
        self._sglang_failed = ""
        detail = "no prefill endpoint"
        rounds = PREFILL_ROUNDS
        failed = False
        while True:
            ep = self._pick(ctx, tried)
            if ep is None:
                rounds -= 1
                if rounds <= 0 or not tried or now() >= ctx.deadline:
                    break
                tried.clear()  # every prefill engine failed once: each may be tried again
                continue
            tried.add(ep.id)
            if failed:
                metrics.child(metrics.disagg_prefill_retries, ctx.model).inc()
            started = now()
            try:
                if decode.spec.engine == "sglang":
                    room = random.randint(0, 2**63 - 1)
                    shaped = sglang_body(body, _host(ep.spec.url), ep.spec.kv_port, room)
                    adapters = self._state.endpoints.adapters
                    shaped = sglang_adapter(shaped, ctx.model if ctx.model in adapters else "")
                    encoded = json.dumps(shaped).encode()
                    task = asyncio.create_task(self._sglang_prefill(ctx, ep, encoded))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                    params: dict[str, Any] | None = None
                else:
                    params = await self._vllm_prefill(ctx, ep, body)
                    encoded = json.dumps(vllm_decode_body(body, params)).encode()
            except UpstreamFailure as failure:
                self._state.record_failure(ep, failure.reason)
                detail = failure.detail
                log.info(
                    "prefill failed",
                    endpoint=ep.id,
                    model=ctx.model,
                    reason=failure.reason,
                    detail=failure.detail,
                )
                failed = True
                continue
            self.decode_sent = now()
            self.seconds = self.decode_sent - started
            self.prefill_id = ep.id
            ctx.body = encoded
            if params is None:  # SGLang's: lora_path already set for both engines
                ctx.sglang_body = (encoded, encoded)
            if params is not None:  # SGLang's prefill runs beside the decode: timed there
                metrics.child(metrics.disagg_phase, ctx.model, "prefill").observe(self.seconds)
            log.info(
                "prefill phase",
                model=ctx.model,
                prefill=ep.id,
                decode=decode.id,
                engine=decode.spec.engine or "vllm",
                prefill_seconds=round(self.seconds, 6),
            )
            return
        raise UpstreamFailure("prefill", f"no prefill engine answered: {detail}")

    def blame(self, failure: UpstreamFailure) -> UpstreamFailure:
        """A decode attempt's failure, as the prefill's when the pair's SGLang prefill failed
        (the decode engine then has no KV to receive: not its fault)."""
        if not self._sglang_failed or failure.reason == "prefill":
            return failure
        return UpstreamFailure(
            "prefill", f"{self._sglang_failed}; the decode engine answered: {failure.detail}"
        )

    def done(self, ctx: RequestContext, decode: Endpoint) -> None:
        """The decode attempt at ``decode`` answered: count the pair and its phases."""
        metrics = self._state.metrics
        ended = now()
        first = ctx.first_byte_at if ctx.first_byte_at >= self.decode_sent else ended
        transfer, rest = first - self.decode_sent, ended - first
        metrics.child(metrics.disagg_pairs, ctx.model, self.prefill_id, decode.id).inc()
        metrics.child(metrics.disagg_phase, ctx.model, "transfer").observe(transfer)
        metrics.child(metrics.disagg_phase, ctx.model, "decode").observe(rest)
        log.info(
            "disaggregated request",
            model=ctx.model,
            prefill=self.prefill_id,
            decode=decode.id,
            engine=decode.spec.engine or "vllm",
            prefill_seconds=round(self.seconds, 6),
            transfer_seconds=round(transfer, 6),
            decode_seconds=round(rest, 6),
        )

    async def _post(self, ctx: RequestContext, ep: Endpoint, body: bytes) -> bytes:
        pool = self._pool
        work = ep.attempt(0)
        answered = False
        sent = now()
        try:
            wait = max(0.0, ctx.deadline - sent)
            by = pool.loop.time() + wait
            response = await pool.post(
                ep.url,
                ctx.path,
                body,
                ctx.headers,
                connect_timeout=ctx.deadlines.connect,
                deadline=by,
                api_key=ep.spec.api_key,
            )
            try:
                payload = await response.read(by)
            finally:
                response.close()
            if response.status != 200:
                raise UpstreamFailure(
                    "status_5xx" if response.status >= 500 else "status_4xx",
                    f"prefill {ep.id} answered {response.status}: {payload[:200]!r}",
                )
            ep.first_byte(0, work, now() - sent)
            answered = True
            self._state.record_success(ep)
            return payload
        except UpstreamFailure:
            raise
        except TimeoutError:
            raise UpstreamFailure("timeout_first_byte", f"prefill {ep.id}: no answer") from None
        except Exception as err:
            raise UpstreamFailure(
                "connect", f"prefill {ep.id}: {type(err).__name__}: {err}"
            ) from None
        finally:
            ep.attempt_ended(0, work, answered, now())

    async def _vllm_prefill(
        self, ctx: RequestContext, ep: Endpoint, body: dict[str, Any]
    ) -> dict[str, Any]:
        payload = await self._post(ctx, ep, json.dumps(vllm_prefill_body(body)).encode())
        params = decode_params(payload)
        if isinstance(params, str):
            raise UpstreamFailure("status_5xx", f"prefill {ep.id}: {params}")
        return params

    async def _sglang_prefill(self, ctx: RequestContext, ep: Endpoint, body: bytes) -> None:
        started = now()
        try:
            await self._post(ctx, ep, body)
            metrics = self._state.metrics
            metrics.child(metrics.disagg_phase, ctx.model, "prefill").observe(now() - started)
        except UpstreamFailure as failure:
            self._state.record_failure(ep, failure.reason)
            self._failed.add(ep.id)
            self._sglang_failed = f"the prefill at {ep.id} failed: {failure.detail}"
            log.info("prefill failed", endpoint=ep.id, model=ctx.model, detail=failure.detail)


def phases_for(state: RouterState, pool: Pool | None, ctx: RequestContext) -> Phases | None:
    """The request's prefill phases when its model is disaggregated (else None).

    The decode endpoints become the candidates: a prefill endpoint never answers a
    client itself (where the model has no decode endpoint, nothing changes).
    """
    roles = split(ctx.candidates)
    if roles is None:
        return None
    prefill, decode = roles
    if decode:
        ctx.candidates = tuple(decode)
    if not prefill or not decode or pool is None or ctx.path not in PHASED_PATHS:
        return None
    engine = decode[0].spec.engine or "vllm"
    if local(len(ctx.body), engine, state.config.disagg.min_prompt_tokens):
        metrics = state.metrics
        metrics.child(metrics.disagg_local, ctx.model).inc()
        return None
    return Phases(state, pool, prefill)
