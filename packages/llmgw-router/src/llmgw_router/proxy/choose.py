"""Stage 4, choose: the endpoint for the next attempt.

What the balancer keys on is read from the request once (session_affinity's key:
the affinity header, else the body's `user`; cache_aware's prompt prefix blocks, and
with precise matching the prompt's token blocks); then each attempt asks the
balancer for one of the candidates, in the tiers retry.py orders for a retry, among
those usable now (all healthy ones in panic). No usable endpoint is a 503 with
`retry-after` from the soonest ejection's end.
"""

from __future__ import annotations

import math

import msgspec
import structlog

from llmgw_router.balancing.prefix import prefix_blocks, prompt_text
from llmgw_router.endpoints import Endpoint
from llmgw_router.errors import ApiError
from llmgw_router.lora import keyed_prompt
from llmgw_router.proxy.context import Headers, RequestContext
from llmgw_router.proxy.parse import RequestHead, RequestHeadWithPrompt
from llmgw_router.proxy.warm import Warmer
from llmgw_router.retry import retry_tiers
from llmgw_router.state import RouterState, now
from llmgw_router.tokens import PromptBlocks, PromptTokenizer

__all__ = ["Chooser"]

log = structlog.get_logger(__name__)


class Chooser:
    """The balancer's inputs from a request, and its pick for each attempt."""

    __slots__ = (
        "_affinity",
        "_affinity_header",
        "_block_bytes",
        "_max_blocks",
        "_tokenizers",
        "cache_aware",
        "state",
        "warmer",
    )

    def __init__(self, state: RouterState) -> None:
        self.state = state
        config = state.config
        self._affinity = config.balancer == "session_affinity"
        self._affinity_header = config.affinity.header.lower().encode()
        self.cache_aware = config.balancer == "cache_aware"
        # Set by the proxy (proxy/warm.py): endpoints leaving, and their recent prompts.
        self.warmer: Warmer | None = None
        self._block_bytes = config.cache_aware.block_bytes
        self._max_blocks = config.cache_aware.max_blocks
        # Precise matching: the tokenizers named by cache_aware.tokenizers (the config
        # check loaded each once already, so these load), shared with /v1/match.
        self._tokenizers = (
            {
                model: tokenizer
                for model in config.cache_aware.tokenizers
                if (tokenizer := state.tokenizer(model)) is not None
            }
            if self.cache_aware
            else {}
        )

    def read_keys(
        self, ctx: RequestContext, headers: Headers, head: RequestHead
    ) -> PromptTokenizer | None:
        """What the balancer keys on, from the request's headers and head; with precise
        matching, the tokenizer to read the prompt's tokens with (:meth:`read_tokens`)
        instead of its text."""
        if self._affinity:
            raw = headers.get(self._affinity_header)
            ctx.affinity_key = raw.decode("latin-1") if raw else head.user
        elif isinstance(head, RequestHeadWithPrompt):
            prompt = head.messages or head.prompt
            if prompt:
                # An adapter's prompt is tokenized as its base model's.
                base = self.state.endpoints.adapters.get(ctx.model, ctx.model)
                tokenizer = self._tokenizers.get(base) if self._tokenizers else None
                if tokenizer is not None:
                    return tokenizer
                ctx.prefix = self._text_prefix(ctx, head)
        return None

    def _text_prefix(self, ctx: RequestContext, head: RequestHeadWithPrompt) -> tuple[int, ...]:
        """The prompt text's prefix blocks (keyed on the adapter for an adapter's request:
        a prefix cached under one adapter is not cached under another)."""
        prompt = head.messages or head.prompt
        text = prompt_text(bytes(prompt), chat=bool(head.messages))
        if ctx.model in self.state.endpoints.adapters:
            text = keyed_prompt(ctx.model, text)
        return prefix_blocks(text, self._block_bytes, self._max_blocks)

    async def read_tokens(
        self,
        ctx: RequestContext,
        head: RequestHeadWithPrompt,
        tokenizer: PromptTokenizer,
    ) -> None:
        """The prompt's token blocks (and their prefix); its text's where it does not tokenize."""
        ctx.tokens = await self._prompt_tokens(tokenizer, head)
        if ctx.tokens is None:
            ctx.prefix = self._text_prefix(ctx, head)
        else:
            if ctx.model in self.state.endpoints.adapters:
                # Its blocks chain from the adapter's root, as the engine's events do.
                ctx.tokens = ctx.tokens.under(ctx.model)
            # Blocks of block_bytes / 4 tokens (about as much prompt).
            ctx.prefix = ctx.tokens.prefix(max(1, self._block_bytes // 4))

    async def _prompt_tokens(
        self, tokenizer: PromptTokenizer, head: RequestHeadWithPrompt
    ) -> PromptBlocks | None:
        """The prompt as the engine tokenizes it; None when not known here. Prefixes
        tokenized before come from the cache; a long new part is encoded off the loop."""
        try:
            if head.messages:
                messages = msgspec.json.decode(head.messages)
                blocks = await tokenizer.chat_blocks(messages, self._max_blocks)
            else:
                prompt = msgspec.json.decode(head.prompt)
                blocks = await tokenizer.completion_blocks(prompt, self._max_blocks)
        except (msgspec.DecodeError, RecursionError):
            return None
        if blocks is None:
            return None
        self.state.metrics.prompts_tokenized.inc()
        return blocks

    def pick(self, ctx: RequestContext) -> Endpoint | None:
        """The balancer's choice for the next attempt; None when no candidate is usable."""
        state = self.state
        balancer = state.balancer
        at = now()
        tokens = ctx.tokens
        cached = (
            (lambda ep: tokens.cached(ep.token_blocks, ep.token_block_size))
            if tokens is not None
            else None
        )
        if not ctx.tried:
            tiers = [list(ctx.candidates)]
        else:
            current = state.endpoints.for_model(ctx.model) or ()
            if ctx.candidates:
                # A retry stays in the role of the first pick (issue 32: a decode attempt
                # never goes to a prefill engine, nor an aggregated one to either).
                role = ctx.candidates[0].spec.role
                current = tuple(ep for ep in current if ep.spec.role == role)
            tiers = retry_tiers(ctx.candidates, current, [t.id for t in ctx.tried], ctx.refused)
        warmer = self.warmer
        for tier in tiers:
            if warmer is not None and warmer.excluded:
                tier = warmer.staying(tier)
            if not tier:
                continue
            usable = state.usable_among(tier, at)
            choice = balancer.choose(tier, usable, ctx.affinity_key, ctx.prefix, cached, at=at)
            ep = choice.endpoint
            if ep is not None:
                # Charged at pick time: a burst between two load reports spreads.
                ep.sent(at)
                if warmer is not None:
                    warmer.note(ep, ctx)
                reason = choice.reason
                if getattr(usable, "__name__", "") == "panic":
                    reason = "panic_" + reason
                ctx.pick_reason, ctx.pick_miss = reason, choice.miss
                state.metrics.child(state.metrics.picks, ctx.model, reason).inc()
                log.debug("picked", model=ctx.model, endpoint=ep.id, reason=reason)
                return ep
        return None

    @staticmethod
    def unavailable(model: str, candidates: tuple[Endpoint, ...]) -> ApiError:
        at = now()
        waits = [
            ep.outlier.ejected_until - at for ep in candidates if ep.outlier.ejected_until > at
        ]
        retry_after = max(1, math.ceil(min(waits))) if waits else 1
        return ApiError(
            503,
            f"no usable endpoint for model `{model}` right now",
            "service_unavailable_error",
            param="model",
            code="no_usable_endpoint",
            headers=[(b"retry-after", str(retry_after).encode())],
        )
