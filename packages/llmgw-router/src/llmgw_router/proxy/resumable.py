"""Stage 6 for a stream that may be resumed (issue 28): the relay that follows it.

Like relay.py's, but it passes on whole SSE events only (a half event is held until
its end comes, so a break never leaves the client half an event), follows them in
the request's :class:`~llmgw_router.proxy.resume.Splice`, and when the engine breaks
off (reset, closed before the answer's end, idle past `idle`) raises
:class:`StreamBroken` instead of ending the stream, so that the exchange can resume
it on another replica. A continuation's events go out rewritten into the client's
stream (its id and created time, no second role chunk, usage over the whole answer).
"""

from __future__ import annotations

import structlog

from llmgw_router.endpoints import Endpoint
from llmgw_router.proxy.context import Reply, RequestContext
from llmgw_router.proxy.relay import Relay, response_headers, usage_from
from llmgw_router.proxy.resume import Splice, split_events
from llmgw_router.state import RouterState, now
from llmgw_router.upstream import Pool, Response, UpstreamError

__all__ = ["ResumableRelay", "StreamBroken"]

log = structlog.get_logger(__name__)


class StreamBroken(Exception):
    """The engine broke off a resumable stream after its first byte."""

    def __init__(self, reason: str, detail: str, at: float) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        # When the client got its last event (event loop clock): the stall starts here.
        self.at = at


class ResumableRelay:
    """Passes one attempt of a resumable stream on to the client."""

    __slots__ = ("plain", "pool", "state")

    def __init__(self, state: RouterState, pool: Pool | None, plain: Relay) -> None:
        self.state = state
        self.pool = pool
        # A first answer that is not an event stream (an engine's 400, say) goes this way.
        self.plain = plain

    async def relay(
        self,
        ctx: RequestContext,
        send: Reply,
        ep: Endpoint,
        response: Response,
        first: bytes,
        splice: Splice,
    ) -> bool:
        """Pass the attempt's events on; True when the stream ended cleanly, else
        StreamBroken. The first attempt starts the client's response; a continuation
        that is not an event stream (the engine refused it) breaks the stream."""
        metrics = self.state.metrics
        model = ctx.model
        deadlines = ctx.deadlines
        assert self.pool is not None
        loop = self.pool.loop
        status = response.status
        streamed = any(
            name == b"content-type" and value.startswith(b"text/event-stream")
            for name, value in response.headers
        )
        continuing = splice.resumes > 0
        if continuing and (status != 200 or not streamed):
            body = first + await _rest(response, loop.time() + deadlines.idle)
            raise StreamBroken(
                "continuation_refused",
                f"{ep.id} answered the continuation with {status}: {body[:200]!r}",
                loop.time(),
            )
        if not continuing:
            if status != 200 or not streamed:
                return await self.plain.relay(ctx, send, ep, response, first)
            splice.started = True
            ctx.first_byte_at = now()
            metrics.child(metrics.ttft, model).observe(ctx.first_byte_at - ctx.started)
            await send.start(status, response_headers(response))
        gap = metrics.child(metrics.gap, model)
        last_at = loop.time()
        total_at = last_at + (ctx.deadline - now())
        idle = deadlines.idle
        held = b""
        chunk = first
        # The last two pieces passed on: a stream's usage and `[DONE]` are at its end.
        previous = last = b""
        try:
            while True:
                if chunk:
                    data = held + chunk if held else chunk
                    if continuing:
                        events, held = split_events(data)
                        data = b"".join([splice.rewrite(event) for event in events])
                    else:
                        # Whole events only: a break must not leave the client half one.
                        end = data.rfind(b"\n\n") + 2
                        if end == 1:
                            data, held = b"", data
                        elif end < len(data):
                            data, held = data[:end], data[end:]
                        else:
                            held = b""
                        if data:
                            splice.feed(data)
                    if data:
                        at = loop.time()
                        gap.observe(at - last_at)
                        last_at = at
                        previous, last = last, data
                        await send.body(data, True)
                chunk = await response.read_chunk(min(last_at + idle, total_at))
                if not chunk:
                    break
        except TimeoutError:
            if loop.time() >= total_at:
                raise StreamBroken(
                    "deadline",
                    f"request exceeded its total deadline of {deadlines.total:g}s",
                    last_at,
                ) from None
            self.state.record_failure(ep, "timeout_idle")
            raise StreamBroken("idle", f"no data from {ep.id} for {idle:g}s", last_at) from None
        except UpstreamError as err:
            self.state.record_failure(ep, "reset")
            raise StreamBroken("reset", f"{ep.id} broke off the response: {err}", last_at) from None
        except BaseException:
            # The client left (at `[DONE]`, say): the usage is counted all the same, as
            # the engines did the work.
            self._count(ctx, splice, previous + last)
            raise
        if continuing or b"data: [DONE]" not in previous + last:
            splice.fold()
        if not splice.done_sent and not splice.finished and b"[DONE]" not in previous + last:
            # The body ended without the answer's end: the engine went away mid-answer.
            self.state.record_failure(ep, "reset")
            raise StreamBroken("closed_early", f"{ep.id} ended the stream early", last_at)
        # A broken attempt's running usage is not the answer's: the one that ends it counts.
        self._count(ctx, splice, previous + last)
        if held:
            await send.body(held, True)
        await send.body(b"")
        ctx.status, ctx.endpoint = ctx.status or status, ep.id
        return True

    def _count(self, ctx: RequestContext, splice: Splice, tail: bytes) -> None:
        """The answer's usage: a continuation's as rewritten, else the stream's last."""
        if splice.resumes:
            found = splice.usage
        else:
            usage = usage_from(tail, True)
            found = None if usage is None else (usage.prompt_tokens, usage.completion_tokens)
        if found is not None:
            metrics = self.state.metrics
            prompt, completion = ctx.usage = found
            metrics.child(metrics.tokens, ctx.model, "prompt").inc(prompt)
            metrics.child(metrics.tokens, ctx.model, "completion").inc(completion)


async def _rest(response: Response, deadline: float) -> bytes:
    try:
        return await response.read(deadline)
    except (TimeoutError, UpstreamError):
        return b""
