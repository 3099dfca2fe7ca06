"""Stage 5, exchange: attempts at endpoints until one answers, or none is left.

Each attempt sends the body unchanged to the endpoint the chooser picked and waits
for the response head and its first body chunk within `first_byte`. A failure up to
there (connect, reset, timeout, 5xx, 429, anything else: never a 500) counts toward
the endpoint's ejection and goes to another endpoint as retry.py decides (retry
count, deadline, 429, budget); when none is left the engine's own 5xx/429 answer is
passed on, else a 502/504 that says why. Once the first byte is in, the relay
(stage 6) has the response, and no retry follows.

The endpoint's figures (outstanding, awaiting a first byte, prefill work, sent and
finished) are the endpoint's to keep: an attempt only tells it when it began, when
its first byte came and when it ended.
"""

from __future__ import annotations

import structlog

from llmgw_router import tracing
from llmgw_router.endpoints import Endpoint
from llmgw_router.engine_errors import openai_error, other_headers
from llmgw_router.errors import error_body, sse_error_event
from llmgw_router.lora import sglang_adapter_body
from llmgw_router.proxy import traced
from llmgw_router.proxy.choose import Chooser
from llmgw_router.proxy.context import Reply, RequestContext, UpstreamFailure, respond
from llmgw_router.proxy.disagg import phases_for
from llmgw_router.proxy.gather import streamed_request
from llmgw_router.proxy.gathering import Gathering
from llmgw_router.proxy.relay import Relay, response_headers
from llmgw_router.proxy.resumable import ResumableRelay, StreamBroken
from llmgw_router.proxy.resume import Decision, Splice, continuation, decide, refusal
from llmgw_router.proxy.routes import in_shape
from llmgw_router.retry import RetryPolicy, Verdict, after_failure
from llmgw_router.state import RouterState, now
from llmgw_router.upstream import ConnectError, Pool, Response, UpstreamError

__all__ = ["Exchange"]

log = structlog.get_logger(__name__)


class Exchange:
    """The retry loop around one request's attempts."""

    __slots__ = (
        "_gather",
        "_max_resumes",
        "_policy",
        "_traced",
        "chooser",
        "pool",
        "relay",
        "resumable",
        "state",
    )

    def __init__(self, state: RouterState, pool: Pool | None, chooser: Chooser) -> None:
        # Read once: tracing is configured before the proxy is built.
        self._traced = tracing.enabled()
        self.state = state
        self.pool = pool
        self.chooser = chooser
        self.relay = Relay(state, pool)
        self.resumable = ResumableRelay(state, pool, self.relay)
        config = state.config
        self._max_resumes = config.retries.max_resumes
        self._gather = bool(self._max_resumes) and config.retries.resume_unstreamed
        self._policy = RetryPolicy(
            max_retries=config.retries.max_retries, retry_on_429=config.retries.retry_on_429
        )

    async def serve(self, ctx: RequestContext, send: Reply) -> None:
        state = self.state
        metrics = state.metrics
        state.budget.on_request(ctx.started)
        last_failure: UpstreamFailure | None = None
        if self._gather and ctx.wrap is None:
            # A non-streamed answer that may be resumed: asked of the engine as a stream
            # and gathered into one JSON answer (proxy/gather.py).
            streamed = streamed_request(ctx.path, ctx.body)
            if streamed is not None:
                ctx.body, send = streamed, Gathering(send, ctx)
        # A stream that may be resumed after its first byte (issue 28): followed as it goes.
        splice = Splice() if self._max_resumes and refusal(ctx.path, ctx.body) is None else None
        original = ctx.body
        broke = ""
        # A disaggregated model (issue 32): a prefill before each decode attempt.
        phases = phases_for(state, self.pool, ctx)
        while True:
            ep = self.chooser.pick(ctx)
            if ep is None:
                if splice is not None and splice.started:
                    detail = last_failure.detail if last_failure else broke
                    await self._broken(ctx, send, splice, "no_replica", detail)
                    return
                if last_failure is not None and ctx.tried:
                    await self._give_up(ctx, send, ctx.tried[-1], last_failure, splice)
                    return
                raise self.chooser.unavailable(ctx.model, ctx.candidates)
            ctx.tried.append(ep)
            try:
                if phases is not None:
                    await phases.before(ctx, ep)
                if self._traced:
                    await self._attempt_traced(ctx, send, ep, splice)
                else:
                    await self._attempt(ctx, send, ep, splice)
                if phases is not None:
                    phases.done(ctx, ep)
                if splice is not None and splice.resumes:
                    log.info(
                        "resumed stream ended",
                        model=ctx.model,
                        resumes=splice.resumes,
                        endpoints=[t.id for t in ctx.tried],
                        tokens=splice.tokens,
                    )
                return
            except StreamBroken as broken:
                assert splice is not None
                if not await self._after_break(ctx, send, ep, splice, broken):
                    return
                broke = f"{broken.detail}; no other replica to resume the stream on"
                last_failure = None
                ctx.body = continuation(ctx.path, original, splice.text, splice.tokens)
                splice.resumed()
                metrics.child(metrics.resumes, ctx.model).inc()
                continue
            except UpstreamFailure as failure:
                if phases is not None:
                    failure = phases.blame(failure)
                last_failure = failure
                if failure.reason == "connect":
                    ctx.refused.add(ep.id)
                if failure.reason != "prefill":  # the prefill engines' failure, counted there
                    state.record_failure(ep, failure.reason)
                log.info(
                    "upstream attempt failed",
                    endpoint=ep.id,
                    model=ctx.model,
                    reason=failure.reason,
                    detail=failure.detail,
                    pick=ctx.pick_reason,
                )
            verdict = after_failure(
                self._policy,
                retries=ctx.retries,
                reason=last_failure.reason,
                now=now(),
                deadline=ctx.deadline,
                spend=state.budget.try_spend,
            )
            if verdict is not Verdict.RETRY:
                if verdict is Verdict.BUDGET:
                    metrics.child(metrics.retries_denied, ctx.model).inc()
                await self._give_up(ctx, send, ep, last_failure, splice, verdict.value)
                return
            ctx.retries += 1
            metrics.child(metrics.retries, ctx.model).inc()

    async def _after_break(
        self, ctx: RequestContext, send: Reply, ep: Endpoint, splice: Splice, broken: StreamBroken
    ) -> bool:
        """After a resumable stream broke: True to resume it; else it was ended here."""
        splice.fold()
        decision = decide(
            max_resumes=self._max_resumes,
            resumes=splice.resumes,
            now=now(),
            deadline=ctx.deadline,
            finished=splice.finished,
            why_not=splice.why_not,
        )
        log.info(
            "stream broke off",
            endpoint=ep.id,
            model=ctx.model,
            reason=broken.reason,
            detail=broken.detail,
            decision=decision.value,
            why_not=splice.why_not or None,
            resumes=splice.resumes,
            tokens=splice.tokens,
        )
        if decision is Decision.RESUME:
            return True
        if decision is Decision.DONE:
            # The whole answer was in: only its end was lost.
            if not splice.done_sent:
                await send.body(b"data: [DONE]\n\n", True)
            await send.body(b"")
            ctx.status, ctx.endpoint = 200, ep.id
            return False
        reason = splice.why_not if decision is Decision.UNRESUMABLE else decision.value
        await self._broken(ctx, send, splice, reason, broken.detail)
        return False

    async def _broken(
        self, ctx: RequestContext, send: Reply, splice: Splice, reason: str, detail: str
    ) -> None:
        """A started stream that cannot go on: the error event, as without resuming."""
        metrics = self.state.metrics
        metrics.child(metrics.resume_failures, ctx.model, reason).inc()
        log.warning(
            "stream failed after first byte",
            model=ctx.model,
            error=detail,
            resume_failed=reason,
            resumes=splice.resumes,
        )
        await send.body(sse_error_event(detail, "upstream_error"))
        # Counted as the failure it is (the relay's rule), not as the 200 its head said.
        ctx.status = 502
        ctx.endpoint = ctx.endpoint or (ctx.tried[-1].id if ctx.tried else "")

    async def _give_up(
        self,
        ctx: RequestContext,
        send: Reply,
        ep: Endpoint,
        failure: UpstreamFailure,
        splice: Splice | None = None,
        why: str = "retries_spent",
    ) -> None:
        if splice is not None and splice.started:
            # A continuation found no engine (``why``: retry.py's verdict): the client's
            # stream has begun, so it ends with the error event.
            await self._broken(ctx, send, splice, why, failure.detail)
            return
        if failure.response is not None:
            # The engine's own answer, in the router's (OpenAI's) error shape.
            status, headers, payload = failure.response
            body = openai_error(status, payload)
            await respond(send, status, in_shape(ctx.path, status, body), other_headers(headers))
        else:
            status = 504 if failure.reason.startswith("timeout") else 502
            body = error_body(
                f"upstream failed for model `{ctx.model}`: {failure.detail}",
                "upstream_error",
                None,
                failure.reason,
            )
            await respond(send, status, in_shape(ctx.path, status, body))
        ctx.status, ctx.endpoint = status, ep.id

    async def _attempt_traced(
        self, ctx: RequestContext, send: Reply, ep: Endpoint, splice: Splice | None
    ) -> None:
        with tracing.span(
            "llmgw.resume" if splice is not None and splice.resumes else "llmgw.upstream",
            endpoint=ep.id,
            attempt=len(ctx.tried),
        ):
            await self._attempt(ctx, send, ep, splice)

    def _body_for(self, ctx: RequestContext, ep: Endpoint) -> bytes:
        """The body as ``ep``'s engine gets it: SGLang names an adapter in ``lora_path``
        (llmgw_router.lora), set to the request's adapter and otherwise removed."""
        if ep.spec.engine != "sglang":
            return ctx.body
        made = ctx.sglang_body
        if made is None or made[0] is not ctx.body:
            adapter = ctx.model if ctx.model in self.state.endpoints.adapters else ""
            made = ctx.sglang_body = (ctx.body, sglang_adapter_body(ctx.body, adapter))
        return made[1]

    async def _attempt(
        self, ctx: RequestContext, send: Reply, ep: Endpoint, splice: Splice | None = None
    ) -> None:
        pool = self.pool
        assert pool is not None
        deadlines = ctx.deadlines
        sent_at = now()
        miss = ctx.pick_miss
        work = ep.attempt(miss)
        answered = False
        response: Response | None = None
        clean = False
        try:
            # On the event loop's clock, which the upstream client's timers use.
            wait = max(0.0, min(deadlines.first_byte, ctx.deadline - sent_at))
            first_byte_by = pool.loop.time() + wait
            try:
                response = await pool.post(
                    ep.url,
                    ctx.path,
                    self._body_for(ctx, ep),
                    traced.upstream_headers(ctx.headers) if self._traced else ctx.headers,
                    connect_timeout=deadlines.connect,
                    deadline=first_byte_by,
                    api_key=ep.spec.api_key,
                    method=ctx.method,
                )
                if ctx.wrap is not None:
                    response = ctx.wrap(response, ep)
                status = response.status
                if status >= 500 or status == 429:
                    payload = await response.read(first_byte_by)
                    raise UpstreamFailure(
                        "status_429" if status == 429 else "status_5xx",
                        f"{ep.id} answered {status}",
                        (status, response_headers(response), payload),
                    )
                first = await response.read_chunk(first_byte_by)
                # Past the queue and the prefill: the engine is generating for it.
                ep.first_byte(miss, work, now() - sent_at)
                answered = True
                if self._traced:
                    tracing.record("llmgw.first_byte", now() - sent_at, status=status)
            except TimeoutError:
                raise UpstreamFailure(
                    "timeout_first_byte",
                    f"{ep.id}: no response within {deadlines.first_byte:g}s",
                ) from None
            except ConnectError as err:
                raise UpstreamFailure("connect", f"{ep.id}: {err}") from None
            except UpstreamError as err:
                raise UpstreamFailure("reset", f"{ep.id}: {err}") from None
            except UpstreamFailure:
                raise
            except Exception as err:
                # Anything else on the way to the engine is its failure, never a 500
                # (issue 24.7): before a response a connect failure, after one a reset.
                raise UpstreamFailure(
                    "connect" if response is None else "reset",
                    f"{ep.id}: {type(err).__name__}: {err}",
                ) from None
            if status < 500:
                self.state.record_success(ep)
            if splice is None:
                clean = await self.relay.relay(ctx, send, ep, response, first)
            else:
                clean = await self.resumable.relay(ctx, send, ep, response, first, splice)
        finally:
            ep.attempt_ended(miss, work, answered, now())
            if response is not None:
                # An unfinished response must not go back to the pool: closing it is
                # also what tells the engine to stop generating.
                if clean:
                    response.release()
                else:
                    response.close()
