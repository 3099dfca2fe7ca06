"""Warming before a drain (issue 28 point 3): a leaving endpoint's hot prefixes move first.

The control plane marks a replica it is about to take away (scale-down, rolling update,
node drain, restart) ``leaving`` in the endpoint snapshot and waits a bounded time before
draining it. On seeing the mark, this router

- keeps sending it the requests the balancer gives it while it warms their new homes (it
  still serves, and holds their prefixes: a request moved to a new home before the warm
  copy's prefill is done would prefill again there), then sends it no new request while
  another endpoint of its model can take it (a retry or a resume may still go there when
  none can); with nothing to warm (or warming off), at once;
- takes the prompts it sent there most often lately (:class:`RecentPrompts`: a bounded
  sample per endpoint, one prompt per rendezvous block, with how often it was sent);
- computes each one's new home: the first of cache_aware's rendezvous ranking of the
  model's endpoints without the leaving ones (what every router computes alike);
- plans (:func:`plan`, pure) which to warm: the most used first, at most
  ``warming.max_requests``, and their prompt tokens together at most
  ``warming.max_prefill_fraction`` of what this router sent the leaving endpoint to
  prefill lately (its last ``cache_aware.window`` requests), never to a leaving endpoint;
- sends each to its new home as a prefill-only request (``max_tokens: 1``, not streamed,
  one choice), ``warming.concurrency`` at a time, in the background and never ahead of
  a client (it takes no tenant's slot; the engine sees one short request);
- points its prefix index at each new home once its copy is answered, so the next requests
  for that prefix go there as a held prefix.

Counted in ``llmgw_router_warm_requests_total{model,outcome}`` and
``llmgw_router_warm_prompt_tokens_total{model}`` (the estimated prompt tokens sent).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from llmgw_router.balancing.cache_aware import CacheAware
from llmgw_router.endpoints import Endpoint

if TYPE_CHECKING:
    from llmgw_router.config import WarmingConfig
    from llmgw_router.proxy.context import RequestContext
    from llmgw_router.state import RouterState
    from llmgw_router.upstream import Pool

__all__ = ["Hot", "RecentPrompts", "Warmer", "plan", "warm_body"]

log = structlog.get_logger(__name__)

# A prompt body larger than this is not kept as a sample (bounded memory per endpoint).
MAX_SAMPLE_BODY = 32 * 1024
# Prompt bytes per token, to estimate a prompt's prefill from its body.
BYTES_PER_TOKEN = 4


@dataclass(slots=True)
class Hot:
    """One recent prompt sent to an endpoint: the latest body with its rendezvous block
    (``key``), and how often a prompt with that block was sent there."""

    key: int
    model: str
    path: str
    body: bytes
    prefix: tuple[int, ...]
    tokens: int
    uses: int = 1


class RecentPrompts:
    """Per endpoint, the last ``per_endpoint`` distinct prompts (by rendezvous block, LRU)
    with their use counts, and the estimated prompt tokens of its last ``window`` requests."""

    def __init__(self, per_endpoint: int, window: int, affinity_blocks: int) -> None:
        self.per_endpoint = max(1, per_endpoint)
        self.window = max(1, window)
        self.affinity_blocks = max(1, affinity_blocks)
        self._hot: dict[str, OrderedDict[int, Hot]] = {}
        self._prefill: dict[str, deque[int]] = {}
        self._prefill_sum: dict[str, int] = {}

    def note(self, endpoint_id: str, ctx: RequestContext) -> None:
        prefix = ctx.prefix
        if not prefix:
            return
        tokens = max(1, len(ctx.body) // BYTES_PER_TOKEN)
        sent = self._prefill.get(endpoint_id)
        if sent is None:
            sent = self._prefill[endpoint_id] = deque()
            self._prefill_sum[endpoint_id] = 0
        sent.append(tokens)
        total = self._prefill_sum[endpoint_id] + tokens
        if len(sent) > self.window:
            total -= sent.popleft()
        self._prefill_sum[endpoint_id] = total
        if len(ctx.body) > MAX_SAMPLE_BODY:
            return
        key = prefix[min(len(prefix), self.affinity_blocks) - 1]
        hot = self._hot.get(endpoint_id)
        if hot is None:
            hot = self._hot[endpoint_id] = OrderedDict()
        found = hot.get(key)
        if found is not None:
            found.uses += 1
            found.body, found.path, found.prefix, found.tokens = (
                ctx.body,
                ctx.path,
                tuple(prefix),
                tokens,
            )
            hot.move_to_end(key)
            return
        hot[key] = Hot(key, ctx.model, ctx.path, ctx.body, tuple(prefix), tokens)
        if len(hot) > self.per_endpoint:
            hot.popitem(last=False)

    def hot(self, endpoint_id: str) -> list[Hot]:
        return list(self._hot.get(endpoint_id, {}).values())

    def recent_prefill(self, endpoint_id: str) -> int:
        """Estimated prompt tokens of the last ``window`` requests sent to the endpoint."""
        return self._prefill_sum.get(endpoint_id, 0)

    def forget(self, endpoint_id: str) -> None:
        self._hot.pop(endpoint_id, None)
        self._prefill.pop(endpoint_id, None)
        self._prefill_sum.pop(endpoint_id, None)


def plan(
    hot: Sequence[Hot],
    leaving: frozenset[str],
    home: Callable[[Hot], str | None],
    *,
    max_requests: int,
    max_tokens: int,
) -> list[tuple[str, Hot]]:
    """Which prompts to warm where: the most used first (ties: the most recent first, as
    ``hot`` lists oldest first), each to its ``home`` (None: none, skipped), never to an
    endpoint in ``leaving``; at most ``max_requests`` of them, their tokens together at
    most ``max_tokens`` (a prompt that would pass that is skipped, a smaller one may
    still fit)."""
    order = sorted(range(len(hot)), key=lambda i: (-hot[i].uses, -i))
    out: list[tuple[str, Hot]] = []
    spent = 0
    for i in order:
        if len(out) >= max_requests:
            break
        h = hot[i]
        if spent + h.tokens > max_tokens:
            continue
        target = home(h)
        if target is None or target in leaving:
            continue
        out.append((target, h))
        spent += h.tokens
    return out


_DROPPED = ("max_completion_tokens", "stream_options", "n", "best_of", "logprobs", "top_logprobs")


def warm_body(body: bytes) -> bytes | None:
    """The prefill-only request for a client's body: ``max_tokens: 1``, not streamed, one
    choice, everything else kept (the prompt and what changes its tokens); None when the
    body is not a JSON object."""
    try:
        data: Any = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    if not isinstance(data, dict):
        return None
    for name in _DROPPED:
        data.pop(name, None)
    data["max_tokens"] = 1
    data["stream"] = False
    return msgspec.json.encode(data)


class Warmer:
    """The router's side of a drain that keeps the cache warm (see the module's doc)."""

    def __init__(self, state: RouterState, pool: Pool, config: WarmingConfig) -> None:
        self.state = state
        self.pool = pool
        self.config = config
        cache_aware = state.config.cache_aware
        self.recent = RecentPrompts(
            config.samples_per_endpoint, cache_aware.window, cache_aware.affinity_blocks
        )
        # Endpoints marked leaving in the current snapshot, and those of them sent no new
        # request any more (warmed, or nothing to warm; checked on every pick).
        self.leaving: frozenset[str] = frozenset()
        self.excluded: frozenset[str] = frozenset()
        self._tasks: set[asyncio.Task[None]] = set()
        state.on_endpoints.append(self._on_endpoints)
        self._on_endpoints()

    # ------------------------------------------------------------ on the request path

    def note(self, ep: Endpoint, ctx: RequestContext) -> None:
        if self.config.enabled and not ep.spec.leaving:
            self.recent.note(ep.id, ctx)

    def staying(self, tier: list[Endpoint]) -> list[Endpoint]:
        """``tier`` without its leaving endpoints done warming, unless none would be left."""
        excluded = self.excluded
        if not excluded:
            return tier
        kept = [ep for ep in tier if ep.id not in excluded]
        return kept or tier

    # ------------------------------------------------------------ on a new snapshot

    def _on_endpoints(self) -> None:
        endpoints = self.state.endpoints.endpoints
        leaving = frozenset(ep.id for ep in endpoints if ep.spec.leaving)
        new = leaving - self.leaving
        self.leaving = leaving
        self.excluded &= leaving
        present = {ep.id for ep in endpoints}
        for gone in [i for i in self.recent._hot if i not in present]:
            self.recent.forget(gone)
        if not new:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or not self.config.enabled:
            self.excluded |= new
            return
        for ep in endpoints:
            if ep.id in new:
                task = loop.create_task(self._warm(ep))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def new_home(self, leaving: Endpoint, h: Hot) -> Endpoint | None:
        balancer = self.state.balancer
        if not isinstance(balancer, CacheAware):
            return None
        candidates = [
            ep
            for ep in self.state.endpoints.for_model(h.model) or ()
            if ep.id not in self.leaving
            and not ep.removed
            and ep.spec.role == leaving.spec.role
            and ep.profile == leaving.profile
        ]
        if not candidates:
            return None
        first: Endpoint = balancer.ranking(candidates, h.prefix)[0]
        return first

    async def _warm(self, leaving: Endpoint) -> None:
        config = self.config
        homes: dict[str, Endpoint] = {}

        def home(h: Hot) -> str | None:
            ep = self.new_home(leaving, h)
            if ep is None:
                return None
            homes[ep.id] = ep
            return ep.id

        budget = int(config.max_prefill_fraction * self.recent.recent_prefill(leaving.id))
        jobs = plan(
            self.recent.hot(leaving.id),
            self.leaving,
            home,
            max_requests=config.max_requests,
            max_tokens=budget,
        )
        log.info("warming", leaving=leaving.id, prompts=len(jobs), token_budget=budget)
        balancer = self.state.balancer
        gate = asyncio.Semaphore(config.concurrency)
        left = [len(jobs)]

        def done() -> None:
            left[0] -= 1
            if left[0] <= 0:
                self.excluded |= {leaving.id} & self.leaving

        if not jobs:
            done()

        async def one(target: Endpoint, h: Hot) -> None:
            body = warm_body(h.body)
            metrics = self.state.metrics
            if body is None:
                done()
                return
            async with gate:
                outcome = "ok"
                try:
                    async with asyncio.timeout(config.timeout):
                        response = await self.pool.post(
                            target.url,
                            h.path,
                            body,
                            [(b"content-type", b"application/json")],
                            connect_timeout=float(self.state.config.deadlines.connect),
                            api_key=target.spec.api_key,
                        )
                        try:
                            await response.read()
                        finally:
                            response.release()
                        if response.status >= 400:
                            outcome = "refused"
                except Exception as exc:  # the engine's answer does not matter: count it
                    outcome = "failed"
                    log.info("warm request failed", endpoint=target.id, error=str(exc))
            # Its prefix is cached there now: the index points at the new home.
            if isinstance(balancer, CacheAware) and outcome == "ok":
                balancer._record(target, h.prefix)
            done()
            metrics.child(metrics.warm_requests, h.model, outcome).inc()
            metrics.child(metrics.warm_tokens, h.model).inc(h.tokens)

        await asyncio.gather(*(one(homes[target], h) for target, h in jobs))
