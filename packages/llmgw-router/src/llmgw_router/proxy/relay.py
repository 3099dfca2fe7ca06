"""Stage 6, relay: the response passed on chunk by chunk, and its usage counted.

After the first byte a failure (idle past `idle`, past the total deadline, the engine
breaking off) can no longer be retried: an SSE stream ends with an error event and
`[DONE]`, a JSON body ends short. The token usage is read from the whole (small) JSON
body or from a stream's last event, and counted even when the client left first.
"""

from __future__ import annotations

import contextlib

import msgspec
import structlog

from llmgw_router.endpoints import Endpoint
from llmgw_router.engine_errors import openai_error, other_headers
from llmgw_router.errors import sse_error_event
from llmgw_router.proxy.context import Reply, RequestContext, respond
from llmgw_router.state import RouterState, now
from llmgw_router.upstream import Pool, Response, UpstreamError

__all__ = ["Relay", "response_headers", "usage_from"]

log = structlog.get_logger(__name__)

# Response headers that describe the hop, not the body: the ASGI server writes its own.
_HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"date", b"server", b"proxy-connection"}
)


# An engine's error answer is read whole up to this, then passed on rewritten.
_MAX_ERROR_BODY = 1 << 16


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # The Responses API's and Anthropic's Messages API's names for the same counts.
    input_tokens: int = 0
    output_tokens: int = 0

    @property
    def counts(self) -> tuple[int, int]:
        """(prompt, completion) tokens, whichever API's names the engine used."""
        return (
            self.prompt_tokens or self.input_tokens,
            self.completion_tokens or self.output_tokens,
        )


class _WithUsage(msgspec.Struct):
    usage: _Usage | None = None


_decode_usage = msgspec.json.Decoder(_WithUsage).decode
_decode_usage_object = msgspec.json.Decoder(_Usage).decode


def response_headers(response: Response) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in response.headers if k not in _HOP_BY_HOP]


def usage_from(tail: bytes, streamed: bool) -> _Usage | None:
    """The usage object of a JSON body, or of the last SSE event that carries one."""
    at = tail.rfind(b'"usage"')
    if at < 0:
        return None
    if not streamed:
        # Usage is mostly the body's last member: `{` + the body from it decodes alone,
        # without walking the choices. Anything else: the whole body.
        with contextlib.suppress(msgspec.DecodeError):
            return _decode_usage(b"{" + tail[at:]).usage
        with contextlib.suppress(msgspec.DecodeError):
            return _decode_usage(tail).usage
        return None
    return _usage_event(tail, at)


def first_usage(data: bytes) -> _Usage | None:
    """The usage of the first SSE event that carries one (an Anthropic stream's
    `message_start`, which alone holds the input tokens), wherever the stream was cut
    into reads: the whole of a short stream can come in one."""
    at = data.find(b'"usage"')
    return None if at < 0 else _usage_event(data, at)


def _usage_event(tail: bytes, at: int) -> _Usage | None:
    """The usage object of the SSE event around the mention of `"usage"` at ``at``."""
    # Only the event around that mention is parsed, not the whole tail.
    start = tail.rfind(b"data: ", 0, at)
    end = tail.find(b"\n", at)
    if start >= 0:
        with contextlib.suppress(msgspec.DecodeError):
            found = _decode_usage(tail[start + 6 : end if end >= 0 else len(tail)]).usage
            if found is not None:
                return found
    # Nested (the Responses API's `response.completed` event: `{"response": {...,
    # "usage": {...}}}`), or an event longer than the tail kept (its whole output text
    # comes with it): the usage object alone.
    return _usage_object(tail, at)


def _usage_object(data: bytes, at: int) -> _Usage | None:
    """The ``{...}`` object after the ``"usage"`` key at ``at``, decoded alone (usage
    objects hold numbers and nested objects of numbers, no strings with braces)."""
    i = at + 7
    n = len(data)
    while i < n and data[i] in b" \t\r\n:":
        i += 1
    if i >= n or data[i] != 0x7B:  # "{": not an object (null, or cut off)
        return None
    depth = 0
    for j in range(i, min(n, i + 4096)):
        c = data[j]
        if c == 0x7B:
            depth += 1
        elif c == 0x7D:
            depth -= 1
            if not depth:
                with contextlib.suppress(msgspec.DecodeError):
                    return _decode_usage_object(data[i : j + 1])
                return None
    return None


class Relay:
    """Passes one response on to the client."""

    __slots__ = ("pool", "state")

    def __init__(self, state: RouterState, pool: Pool | None) -> None:
        self.state = state
        self.pool = pool

    async def relay(
        self, ctx: RequestContext, send: Reply, ep: Endpoint, response: Response, first: bytes
    ) -> bool:
        """Pass the response on chunk by chunk; True when it ended cleanly."""
        metrics = self.state.metrics
        model = ctx.model
        deadlines = ctx.deadlines
        assert self.pool is not None
        loop = self.pool.loop
        status = response.status
        content_type = b""
        for name, value in response.headers:
            if name == b"content-type":
                content_type = value
                break
        streamed = content_type.startswith(b"text/event-stream")
        if status >= 400:
            return await self._error(ctx, send, ep, response, first)
        ctx.first_byte_at = now()
        ttft = ctx.first_byte_at - ctx.started
        metrics.child(metrics.ttft, model).observe(ttft)
        await send.start(status, response_headers(response))
        # What usage is read from: the whole (small) JSON body, or a stream's last chunks.
        previous = b""
        last = first
        collected = bytearray(first) if not streamed else None
        clean = ended = False
        failure = ""
        cut = status
        # The usage is counted even when the client leaves first: a client that closes on
        # `data: [DONE]` can be gone before the upstream's end is read, and the engine did
        # the work either way.
        try:
            if first and response.at_eof:
                # All of it came in one read (small JSON answers, fast short streams): one write.
                clean = ended = True
                await send.body(first)
            elif first:
                gap = metrics.child(metrics.gap, model) if streamed else None
                await send.body(first, True)
                # The chunk loop runs on the event loop's clock (what the client's timers use),
                # with the request's deadline carried over from the router's clock once.
                last_at = loop.time()
                total_at = last_at + (ctx.deadline - now())
                idle = deadlines.idle
                try:
                    while True:
                        chunk = await response.read_chunk(min(last_at + idle, total_at))
                        if not chunk:
                            clean = True
                            break
                        at = loop.time()
                        if gap is not None:
                            gap.observe(at - last_at)
                        last_at = at
                        previous, last = last, chunk
                        if collected is not None and len(collected) < 1 << 20:
                            collected += chunk
                        await send.body(chunk, True)
                except TimeoutError:
                    failure = (
                        f"no data from {ep.id} for {idle:g}s"
                        if loop.time() < total_at
                        else f"request exceeded its total deadline of {deadlines.total:g}s"
                    )
                    self.state.record_failure(ep, "timeout_idle")
                except UpstreamError as err:
                    failure = f"{ep.id} broke off the response: {err}"
                    self.state.record_failure(ep, "reset")
            else:
                clean = True
            if failure:
                log.warning(
                    "stream failed after first byte", endpoint=ep.id, model=model, error=failure
                )
                # Counted as what it is, not as the 200 its head said.
                cut = 504 if "deadline" in failure or failure.startswith("no data") else 502
                if streamed:
                    await send.body(sse_error_event(failure, "upstream_error"))
                else:
                    # Nothing honest can be appended to a half-sent JSON body: end it short.
                    await send.body(b"")
            elif not ended:
                await send.body(b"")
        finally:
            usage = usage_from(
                bytes(collected) if collected is not None else previous + last, streamed
            )
            if usage is not None:
                prompt, completion = usage.counts
                if streamed and not prompt and first:
                    # An Anthropic stream: its input tokens came in its first event
                    # (`message_start`), its last usage (`message_delta`) has the output.
                    early = first_usage(first)
                    if early is not None:
                        prompt = early.counts[0]
                ctx.usage = prompt, completion
                metrics.child(metrics.tokens, model, "prompt").inc(prompt)
                metrics.child(metrics.tokens, model, "completion").inc(completion)
        ctx.status, ctx.endpoint = (cut if failure else status), ep.id
        return clean

    async def _error(
        self, ctx: RequestContext, send: Reply, ep: Endpoint, response: Response, first: bytes
    ) -> bool:
        """An engine's error answer (4xx; 5xx past retries come through exchange): read
        whole (bounded), passed on in OpenAI's shape like the router's own errors."""
        assert self.pool is not None
        loop = self.pool.loop
        body = bytearray(first)
        clean = response.at_eof
        if not clean:
            until = loop.time() + ctx.deadlines.idle
            try:
                while len(body) < _MAX_ERROR_BODY:
                    chunk = await response.read_chunk(until)
                    if not chunk:
                        clean = True
                        break
                    body += chunk
            except (TimeoutError, UpstreamError):
                pass  # what came is the message
        status = response.status
        await respond(
            send,
            status,
            openai_error(status, bytes(body)),
            other_headers(response_headers(response)),
        )
        ctx.status, ctx.endpoint = status, ep.id
        return clean
