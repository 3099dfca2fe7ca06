"""Warming before a drain (issue 28 point 3): a leaving endpoint's hot prefixes move first,
and a joining endpoint takes the prefixes it becomes the home of only once they are warm.

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

An endpoint that joins (in a rolling update, the surge replica; or a scale-up) is the
first rendezvous choice of about one prefix in ``n``, and cache_aware sends a prefix
back to its first choice once that is no more loaded than its holder: every such
prefix would miss on the empty newcomer. So on seeing a new endpoint, this router

- takes its peers' samples (the model's endpoints of its profile and role, leaving ones
  included, merged by rendezvous block: :func:`merged`) and plans, the same way and
  within the same bounds (the budget: ``max_prefill_fraction`` of the mean of what the
  staying peers were sent lately), copies of those whose new home (the first of the
  ranking of the staying endpoints, the newcomer among them) is the newcomer;
- holds the newcomer out of its picks until those copies are answered (at most
  ``warming.timeout``, and no longer than a leaving endpoint stays published: once one is
  gone its prefixes' new homes must take them, warm or not): meanwhile its prefixes stay
  with their holders (a leaving one included: a leaving endpoint done warming still takes
  requests while a joiner is held);
  a copy answered points the index at it, so the prefix then goes there as a held one.
  With nothing to warm, it takes requests at once.

A prompt is warmed on one endpoint once (a join and a leave in one rollout step plan
against each other's copies).

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

__all__ = ["Hot", "RecentPrompts", "Warmer", "merged", "plan", "warm_body"]

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


def merged(lists: Sequence[Sequence[Hot]]) -> list[Hot]:
    """Several endpoints' samples as one (a prompt spread over several is one prompt):
    by rendezvous block, its uses summed and the latest sample's body kept (the later
    list's where two carry it), in the order of first appearance."""
    out: dict[int, Hot] = {}
    for hot in lists:
        for h in hot:
            found = out.get(h.key)
            if found is None:
                out[h.key] = Hot(h.key, h.model, h.path, h.body, h.prefix, h.tokens, h.uses)
            else:
                found.uses += h.uses
                found.body, found.path, found.prefix, found.tokens = (
                    h.body,
                    h.path,
                    h.prefix,
                    h.tokens,
                )
    return list(out.values())


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
    """The router's side of a drain that keeps the cache warm, and of a replica that joins
    warm (see the module's doc)."""

    def __init__(self, state: RouterState, pool: Pool, config: WarmingConfig) -> None:
        self.state = state
        self.pool = pool
        self.config = config
        cache_aware = state.config.cache_aware
        self.recent = RecentPrompts(
            config.samples_per_endpoint, cache_aware.window, cache_aware.affinity_blocks
        )
        # Endpoints marked leaving in the current snapshot, and the endpoints sent no new
        # request for now (checked on every pick): joining ones until their warm copies
        # are answered, and leaving ones done warming once no joiner is held.
        self.leaving: frozenset[str] = frozenset()
        self.excluded: frozenset[str] = frozenset()
        self._left: set[str] = set()
        self._held: set[str] = set()
        # Per endpoint, the rendezvous blocks warmed there (or being): no copy twice.
        self._sent: dict[str, set[int]] = {}
        # The endpoints of the last snapshot (one not among them joins).
        self._known: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        state.on_endpoints.append(self._on_endpoints)
        self._on_endpoints()

    # ------------------------------------------------------------ on the request path

    def note(self, ep: Endpoint, ctx: RequestContext) -> None:
        if self.config.enabled and not ep.spec.leaving:
            self.recent.note(ep.id, ctx)

    def staying(self, tier: list[Endpoint]) -> list[Endpoint]:
        """``tier`` without the endpoints held out (joining ones warming, leaving ones done
        warming), unless none would be left."""
        excluded = self.excluded
        if not excluded:
            return tier
        kept = [ep for ep in tier if ep.id not in excluded]
        return kept or tier

    # ------------------------------------------------------------ on a new snapshot

    def _refresh(self) -> None:
        # A leaving endpoint keeps its prefixes while a joiner is held: its heirs may be
        # the joiner, and sending them elsewhere meanwhile would be a miss there.
        held = self._held
        self.excluded = frozenset(held) if held else frozenset(self._left & self.leaving)

    def _on_endpoints(self) -> None:
        endpoints = self.state.endpoints.endpoints
        present = {ep.id for ep in endpoints}
        leaving = frozenset(ep.id for ep in endpoints if ep.spec.leaving)
        new = leaving - self.leaving
        joined = [ep for ep in endpoints if ep.id not in self._known and not ep.spec.leaving]
        if self.leaving - present:
            # A leaving endpoint is gone (its warning ended, the control plane drains it):
            # its prefixes have no holder left, and a held joiner is the new home of some.
            # Held out, they would go to a third endpoint and miss there.
            self._held.clear()
        self.leaving = leaving
        self._known = present
        self._left &= leaving
        self._held &= present
        for gone in [i for i in self._sent if i not in present]:
            del self._sent[gone]
        for gone in [i for i in self.recent._hot if i not in present]:
            self.recent.forget(gone)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or not self.config.enabled:
            self._left |= new
            self._refresh()
            return
        new_leaving = [ep for ep in endpoints if ep.id in new]
        jobs = self._change_plan(joined, new_leaving)
        held = {target.id for target, _ in jobs} & {ep.id for ep in joined}
        self._held |= held
        self._left |= new - {ep.id for ep in new_leaving if jobs}
        if jobs:
            for target, h in jobs:
                self._sent.setdefault(target.id, set()).add(h.key)
            task = loop.create_task(self._warm(jobs, held, new))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._refresh()

    def _peers(self, model: str, like: Endpoint) -> list[Endpoint]:
        """The model's endpoints of ``like``'s profile and role that stay (not leaving,
        not removed): the ranking a prefix's new home is the first of."""
        return [
            ep
            for ep in self.state.endpoints.for_model(model) or ()
            if ep.id not in self.leaving
            and not ep.removed
            and ep.spec.role == like.spec.role
            and ep.profile == like.profile
        ]

    def new_home(self, like: Endpoint, h: Hot) -> Endpoint | None:
        balancer = self.state.balancer
        if not isinstance(balancer, CacheAware):
            return None
        candidates = self._peers(h.model, like)
        if not candidates:
            return None
        first: Endpoint = balancer.ranking(candidates, h.prefix)[0]
        return first

    def _planned(
        self,
        hot: Sequence[Hot],
        home: Callable[[Hot], Endpoint | None],
        budget: int,
        already: int = 0,
    ) -> list[tuple[Endpoint, Hot]]:
        homes: dict[str, Endpoint] = {}

        def target(h: Hot) -> str | None:
            ep = home(h)
            if ep is None or h.key in self._sent.get(ep.id, ()):
                return None
            homes[ep.id] = ep
            return ep.id

        config = self.config
        jobs = plan(
            hot,
            self.leaving,
            target,
            max_requests=max(0, config.max_requests - already),
            max_tokens=max(0, budget),
        )
        return [(homes[t], h) for t, h in jobs]

    def _change_plan(
        self, joined: Sequence[Endpoint], left: Sequence[Endpoint]
    ) -> list[tuple[Endpoint, Hot]]:
        """One plan for what a snapshot changed, per pool (profile and role) that an
        endpoint joined or began leaving: the prompts sampled on the pool's endpoints
        (merged), each warmed on its new home (the first of the ranking of the staying
        endpoints) where it moves there: sampled on a leaving endpoint, or its new home
        a joiner; not where that home holds it already; the leaving endpoints' first. One budget for the lot: the
        leaving endpoints' ``max_prefill_fraction`` of what they were sent lately (a
        rolling update's step, a joiner and a leaving one, costs what a drain does), or
        with none leaving, that of the mean staying endpoint per joiner."""
        pools: dict[tuple[str, str], tuple[list[Endpoint], list[Endpoint]]] = {}
        for ep in joined:
            pools.setdefault((ep.profile, ep.spec.role), ([], []))[0].append(ep)
        for ep in left:
            pools.setdefault((ep.profile, ep.spec.role), ([], []))[1].append(ep)
        fraction = self.config.max_prefill_fraction
        recent = self.recent
        jobs: list[tuple[Endpoint, Hot]] = []
        for (profile, role), (joins, leaves) in pools.items():
            members = [
                ep
                for ep in self.state.endpoints.endpoints
                if ep.profile == profile and ep.spec.role == role and not ep.removed
            ]
            joining = {ep.id for ep in joins}
            moving = {ep.id for ep in leaves}
            held: dict[int, set[str]] = {}
            lists: list[list[Hot]] = []
            # The leaving endpoints' samples last: their bodies win in the merge.
            for ep in sorted(members, key=lambda ep: ep.id in moving):
                hot = recent.hot(ep.id)
                lists.append(hot)
                for h in hot:
                    held.setdefault(h.key, set()).add(ep.id)
            hot = merged(lists)
            if not hot:
                continue
            if leaves:
                budget = sum(fraction * recent.recent_prefill(ep.id) for ep in leaves)
            else:
                staying = [ep for ep in members if ep.id not in self.leaving | joining]
                mean = sum(recent.recent_prefill(ep.id) for ep in staying) / max(1, len(staying))
                budget = fraction * mean * len(joins)
            home = self._mover((leaves or joins)[0], held, joining, moving)
            # A leaving endpoint's prompts first: they all move, where a prompt held
            # elsewhere moves to a joiner where cache_aware sends it back there (or no
            # longer remembers its holder).
            first = [h for h in hot if held[h.key] & moving]
            planned = self._planned(first, home, int(budget))
            spent = sum(h.tokens for _, h in planned)
            rest = [h for h in hot if not held[h.key] & moving]
            planned += self._planned(rest, home, int(budget) - spent, len(planned))
            log.info(
                "warming",
                joining=sorted(joining),
                leaving=sorted(moving),
                prompts=len(planned),
                token_budget=int(budget),
            )
            jobs += planned
        return jobs

    def _mover(
        self, like: Endpoint, held: dict[int, set[str]], joining: set[str], moving: set[str]
    ) -> Callable[[Hot], Endpoint | None]:
        """A sampled prompt's new home where it moves there (see :meth:`_change_plan`)."""

        def home(h: Hot) -> Endpoint | None:
            ep = self.new_home(like, h)
            holders = held[h.key]
            if ep is None or ep.id in holders:
                return None
            return ep if ep.id in joining or holders & moving else None

        return home

    async def _warm(
        self, jobs: list[tuple[Endpoint, Hot]], held: set[str], leaving: frozenset[str]
    ) -> None:
        """Send the copies, ``concurrency`` at a time (those to a held joiner first);
        the joiners take requests once their copies are answered (or ``timeout`` has
        passed), the leaving endpoints none once all are."""
        gate = asyncio.Semaphore(self.config.concurrency)
        jobs = sorted(jobs, key=lambda job: job[0].id not in held)
        tasks = [asyncio.ensure_future(self._one(gate, target, h)) for target, h in jobs]
        to_held = [t for t, (target, _) in zip(tasks, jobs, strict=True) if target.id in held]
        try:
            if to_held:
                await asyncio.wait(to_held, timeout=self.config.timeout)
        finally:
            self._held -= held
            self._refresh()
        try:
            await asyncio.gather(*tasks)
        finally:
            self._left |= leaving & self.leaving
            self._refresh()

    async def _one(self, gate: asyncio.Semaphore, target: Endpoint, h: Hot) -> None:
        config = self.config
        body = warm_body(h.body)
        if body is None:
            return
        metrics = self.state.metrics
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
        balancer = self.state.balancer
        if isinstance(balancer, CacheAware) and outcome == "ok":
            balancer._record(target, h.prefix)
        metrics.child(metrics.warm_requests, h.model, outcome).inc()
        metrics.child(metrics.warm_tokens, h.model).inc(h.tokens)
