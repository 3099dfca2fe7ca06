"""Endpoints and the immutable set of them the router serves from.

An :class:`Endpoint` carries both what the control plane (or the config) says about
an engine replica and the router's live view of it (outstanding requests, ejection,
health). An :class:`EndpointSet` is never changed after it is built: a new snapshot
builds a new set and the router swaps it in with one assignment, so a request that
already picked an endpoint keeps that object to the end.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from llmgw_router.outlier import OutlierState

# Token blocks kept per endpoint at most (the control plane relays up to 200,000).
MAX_TOKEN_BLOCKS = 1_000_000

__all__ = [
    "MAX_TOKEN_BLOCKS",
    "CacheChange",
    "Endpoint",
    "EndpointSet",
    "EndpointSpec",
    "EngineLoad",
]


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """The engine's own figures for one endpoint, as the control plane relayed them."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    generation: int = 0
    # On the router's clock (time.monotonic): when the engine's figures were read.
    measured_at: float = 0.0
    # The engine's KV cache, in tokens (vLLM: num_gpu_blocks x block_size); 0: not told.
    cache_tokens: int = 0
    # The engine's prefill rate, prompt tokens per second, learned by its agent from the
    # engine's own metrics; 0: not told.
    prefill_tokens_per_second: float = 0.0


@dataclass(frozen=True, slots=True)
class CacheChange:
    """One change to an engine's KV cache, as the control plane relayed it: blocks stored
    and removed (by token-id hashes when ``by_token_ids``, else the engine's own), or a
    clear; ``generation`` names the engine process (0: not told)."""

    cleared: bool = False
    generation: int = 0
    stored: Sequence[int] = ()
    removed: Sequence[int] = ()
    by_token_ids: bool = False
    block_size: int = 0


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    """What the router is told about one replica."""

    id: str
    url: str
    models: tuple[str, ...]
    profile: str = "static"
    weight: int = 1
    health_path: str = "/health"
    node_id: str = ""
    replica_id: str = ""
    labels: tuple[tuple[str, str], ...] = ()
    # Changes whenever the engine process behind the endpoint changes (0: not told).
    generation: int = 0
    # The engine's KV cache in tokens, as configured (static endpoints); 0: not told.
    cache_tokens: int = 0
    # The engine's secret, sent upstream as Authorization: Bearer (from the control
    # plane); never shown (/v1/endpoints, logs) and never the client's own header.
    api_key: str = field(default="", repr=False)
    # The HTTP paths the engine serves (from the control plane: the agent read them);
    # empty: not known, and the endpoint is sent any route.
    routes: frozenset[str] = frozenset()
    # A disaggregated model's pool (issue 32, proxy/disagg.py): "prefill" or "decode"
    # ("" aggregated), the engine family ("vllm", "sglang"; "" not told) and the engine's
    # KV port (SGLang's bootstrap port; 0: none).
    role: str = ""
    engine: str = ""
    kv_port: int = 0
    # The control plane is about to take it away (issue 28): no new requests while
    # another endpoint can take them (proxy/warm.py).
    leaving: bool = False
    # Its place within its model/profile (Endpoint.slot, issue 28): cache_aware ranks by
    # it, so a replacement in the same slot inherits exactly its predecessor's prefixes;
    # "": not known, ranked by id.
    slot: str = ""


@dataclass(eq=False, slots=True)
class Endpoint:
    # The defaults of `max_age` and `block_tokens` below, for an endpoint no router state
    # has configured (never changed: each router state sets its own endpoints' values).
    load_max_age: ClassVar[float] = 2.0
    tokens_per_block: ClassVar[float] = 64.0

    spec: EndpointSpec
    outstanding: int = 0
    # Of those, the ones without a first byte yet: queued or in prefill at the engine,
    # what the next request's time to first token waits behind.
    awaiting_first: int = 0
    outlier: OutlierState = field(default_factory=OutlierState)
    # Active health checks; an endpoint starts healthy so it serves before the first probe.
    healthy: bool = True
    health_failures: int = 0
    health_successes: int = 0
    removed: bool = False
    # Engine-reported load (None: never reported, or reported unknown), and what this
    # router did to it since the engine's figures were read: requests sent (charged at
    # pick time) and requests finished, each with when (see `load`).
    engine: EngineLoad | None = None
    sent_since_report: int = 0
    finished_since_report: int = 0
    _events: deque[tuple[float, int]] = field(default_factory=deque)
    # From the engine's KV-cache events (EndpointCache): blocks it holds now, and when
    # the agent names them by their token ids (token_blocks), which ones and their size.
    cached_blocks: int = 0
    token_blocks: set[int] | None = None
    token_block_size: int = 0
    # The newest engine generation heard of, from the snapshot or a load report.
    engine_generation: int = 0
    # cache_aware's predicted time to first token: the prefix blocks this router's
    # requests here still have to prefill (their predicted misses, until their first
    # byte), the typical miss of a request sent here, and the seconds one block takes
    # (learned from those requests' times to first byte; 0 until one is measured).
    pending_blocks: float = 0.0
    typical_miss: float = 0.0
    learned_block_time: float = 0.0
    # Set by the router's state from its config (RouterState.configure): a figure older
    # than `max_age` counts as unknown (`load_reports.max_age`); the engine's tokens in one
    # of cache_aware's prefix blocks (block_bytes / bytes_per_token), to count an engine's
    # cache in prefix blocks.
    max_age: float = load_max_age
    block_tokens: float = tokens_per_block
    # The LoRA adapters its engine holds, from its load reports (llmgw_router.lora).
    adapters: frozenset[str] = frozenset()

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def weight(self) -> int:
        return self.spec.weight

    @property
    def profile(self) -> str:
        return self.spec.profile

    @property
    def slot(self) -> str:
        return self.spec.slot

    @property
    def generation(self) -> int:
        return max(self.spec.generation, self.engine_generation)

    @property
    def cache_tokens(self) -> int:
        """The engine's KV cache in tokens: as it reports, else as configured; 0: unknown."""
        engine = self.engine
        if engine is not None and engine.cache_tokens > 0:
            return engine.cache_tokens
        return self.spec.cache_tokens

    @property
    def cache_blocks(self) -> int:
        """The engine's KV cache in cache_aware's prefix blocks; 0: unknown."""
        return int(self.cache_tokens / self.block_tokens)

    def pending_at(self, now: float) -> float:
        """Prefix blocks queued for prefill ahead of a new request here: this router's
        (predicted), plus, where the engine reports more requests waiting than this router
        has awaiting a first byte there, those others at this router's typical miss."""
        pending = self.pending_blocks
        engine = self.fresh_engine(now)
        if engine is not None and engine.waiting > self.awaiting_first:
            pending += (engine.waiting - self.awaiting_first) * self.typical_miss
        return pending

    @property
    def block_time(self) -> float:
        """Seconds to prefill one prefix block here: from the engine's own prefill rate
        where its agent reports one, else learned from this router's times to first byte
        (0: neither yet)."""
        engine = self.engine
        if engine is not None and engine.prefill_tokens_per_second > 0:
            return self.block_tokens / engine.prefill_tokens_per_second
        return self.learned_block_time

    # ------------------------------------------------------------- one request's course
    # The endpoint keeps its own figures: the request path only says when an attempt
    # began, when its first byte came, and when it ended (with the time, on the
    # router's clock, where the figures keep one).

    def attempt(self, miss: int) -> float:
        """A request predicted to prefill ``miss`` prefix blocks is sent here now: in flight
        and awaiting its first byte. Returns the prefix blocks ahead of its first token,
        its own included, which :meth:`first_byte` and :meth:`attempt_ended` are given
        back (a number, not an object, and these three inline begin_prefill, end_prefill
        and finished: they are on every request's path)."""
        self.outstanding += 1
        self.awaiting_first += 1
        work = self.pending_blocks + miss
        self.pending_blocks = work
        self.typical_miss += 0.1 * (miss - self.typical_miss)
        return work

    def first_byte(self, miss: int, work: float, seconds: float) -> None:
        """That attempt's first byte came ``seconds`` after it was sent: past the queue and
        the prefill, the engine is generating for it. Told once per attempt."""
        self.awaiting_first -= 1
        self.pending_blocks = max(0.0, self.pending_blocks - miss)
        if work >= 8:
            # As end_prefill: only where the prefill dominates.
            sample = seconds / work
            old = self.learned_block_time
            self.learned_block_time = sample if old <= 0 else old + 0.1 * (sample - old)

    def attempt_ended(self, miss: int, work: float, answered: bool, at: float) -> None:
        """That attempt ended at ``at`` (answered, failed or cancelled); ``answered``: its
        first byte was told (:meth:`first_byte`)."""
        self.outstanding -= 1
        if not answered:
            self.awaiting_first -= 1
            self.pending_blocks = max(0.0, self.pending_blocks - miss)
        if self.engine is not None:
            # As finished(at).
            self.finished_since_report += 1
            self._event(at, -1)

    def begin_prefill(self, miss: int) -> float:
        """A request predicted to prefill ``miss`` prefix blocks was sent here: the blocks
        ahead of its first token, its own included."""
        work = self.pending_blocks + miss
        self.pending_blocks = work
        self.typical_miss += 0.1 * (miss - self.typical_miss)
        return work

    def end_prefill(self, miss: int, work: float, seconds: float | None) -> None:
        """That request's first byte came after ``seconds`` (None: it failed first)."""
        self.pending_blocks = max(0.0, self.pending_blocks - miss)
        if seconds is not None and work >= 8:
            # Only where the prefill dominates: a hit's first token is mostly a step.
            sample = seconds / work
            old = self.learned_block_time
            self.learned_block_time = sample if old <= 0 else old + 0.1 * (sample - old)

    def fresh_engine(self, now: float) -> EngineLoad | None:
        """The engine's figures when they are recent enough to balance on."""
        engine = self.engine
        if engine is None or now - engine.measured_at > self.max_age:
            return None
        return engine

    def load_at(self, now: float) -> float:
        """What the load-aware balancer weighs.

        The engine's running and waiting requests when its figures were read, plus the
        requests this router sent it since, less those of its requests that finished
        since, plus KV-cache use (0..1); never less than this router's own in-flight
        count, which is a floor of the truth. This router's own in-flight count alone
        when the engine's figures are unknown or stale. Other routers' sends and
        completions since the reading are not known here: they come with the next one."""
        engine = self.fresh_engine(now)
        if engine is None:
            return float(self.outstanding)
        since = self.sent_since_report - self.finished_since_report
        return max(engine.running + engine.waiting + since, self.outstanding) + (
            engine.kv_cache_usage
        )

    def sent(self, at: float) -> None:
        """This router picked the endpoint for a request (at ``at``, time.monotonic).

        Counted only while there are engine figures to correct: without them the load
        is this router's own in-flight count, and a first report covers what it saw."""
        if self.engine is not None:
            self.sent_since_report += 1
            self._event(at, 1)

    def finished(self, at: float) -> None:
        """A request this router sent here ended (answered, failed or cancelled)."""
        if self.engine is not None:
            self.finished_since_report += 1
            self._event(at, -1)

    def _event(self, at: float, kind: int) -> None:
        events = self._events
        events.append((at, kind))
        if len(events) > 4096:
            # No report for a long while: the oldest count no more (the figures that
            # would have covered them are stale anyway, and `load` falls back).
            self._drop(events.popleft())

    def _drop(self, event: tuple[float, int]) -> None:
        if event[1] > 0:
            self.sent_since_report -= 1
        else:
            self.finished_since_report -= 1

    def report(self, load: EngineLoad | None) -> None:
        """A new engine report (None: unknown) replaces the old one; what this router did
        before the engine's figures were read is in them, and no longer counted apart."""
        self.engine = load
        events = self._events
        if load is None:
            events.clear()
            self.sent_since_report = self.finished_since_report = 0
            return
        measured_at = load.measured_at
        while events and events[0][0] <= measured_at:
            self._drop(events.popleft())
        if load.generation > self.engine_generation:
            self.engine_generation = load.generation

    def cache_changed(self, change: CacheChange) -> None:
        """The engine's cache changed: its block count, and its blocks when named by token ids.

        A clear starts a view (empty: the agent's first word on a new engine is a clear
        with nothing in it yet); blocks stored under the engine's own hashes end it (None:
        the engine's events carry no token ids, nothing to match a prompt against)."""
        stored, removed = change.stored, change.removed
        if change.cleared or (change.generation and change.generation != self.generation):
            self.cached_blocks = 0
            self.token_blocks = set()
        self.cached_blocks = max(0, self.cached_blocks + len(stored) - len(removed))
        if stored and not change.by_token_ids:
            self.token_blocks = None
            return
        blocks = self.token_blocks
        if blocks is None:
            return
        if change.block_size:
            self.token_block_size = change.block_size
        blocks.difference_update(removed)
        blocks.update(stored)
        if len(blocks) > MAX_TOKEN_BLOCKS:
            self.token_blocks = None

    def usable(self, now: float) -> bool:
        return self.healthy and not self.removed and self.outlier.ejected_until <= now

    def state(self, now: float) -> str:
        if self.removed:
            return "removed"
        if self.outlier.ejected_until > now:
            return "ejected"
        if not self.healthy:
            return "unhealthy"
        return "ready"


class EndpointSet:
    """All endpoints of one snapshot, indexed by served model name."""

    __slots__ = ("_by_model", "adapters", "by_id", "declared", "endpoints", "source", "version")

    def __init__(
        self,
        endpoints: Iterable[Endpoint],
        *,
        version: int = 0,
        source: str = "",
        declared: Mapping[str, bool] | None = None,
        adapters: Mapping[str, str] | None = None,
    ) -> None:
        self.endpoints: tuple[Endpoint, ...] = tuple(endpoints)
        # LoRA adapters the control plane declares: adapter name -> its base model's
        # served name (whose endpoints may hold it; llmgw_router.lora).
        self.adapters: Mapping[str, str] = dict(adapters or {})
        self.version = version
        self.source = source
        # Served model names the control plane declares, with or without endpoints:
        # name -> scale_to_zero.
        self.declared: Mapping[str, bool] = dict(declared or {})
        self.by_id: Mapping[str, Endpoint] = {ep.id: ep for ep in self.endpoints}
        by_model: dict[str, list[Endpoint]] = {}
        for ep in self.endpoints:
            for model in ep.spec.models:
                by_model.setdefault(model, []).append(ep)
        self._by_model: Mapping[str, tuple[Endpoint, ...]] = {
            m: tuple(eps) for m, eps in by_model.items()
        }

    def for_model(self, model: str) -> tuple[Endpoint, ...] | None:
        return self._by_model.get(model)

    @property
    def models(self) -> list[str]:
        return sorted(self._by_model)

    def __len__(self) -> int:
        return len(self.endpoints)

    def successor(
        self,
        specs: Iterable[EndpointSpec],
        *,
        version: int,
        source: str,
        declared: Mapping[str, bool] | None = None,
        adapters: Mapping[str, str] | None = None,
    ) -> EndpointSet:
        """The set for new ``specs``, keeping the live state of endpoints that did not change.

        An endpoint whose id and URL are unchanged is the same object in the new set, so
        its outstanding count and ejection carry over; one that is gone is marked
        removed, and the requests in flight on it still finish there.
        """
        old = {ep.id: ep for ep in self.endpoints}
        kept: list[Endpoint] = []
        for spec in specs:
            prev = old.pop(spec.id, None)
            if prev is not None and prev.spec == spec:
                kept.append(prev)
            elif prev is not None and prev.spec.url == spec.url:
                # Same engine, new attributes (weight, models): the same object, so the
                # requests in flight on it still count against it.
                if spec.generation != prev.spec.generation:
                    # Another engine process: its predecessor's figures say nothing.
                    prev.report(None)
                prev.spec = spec
                kept.append(prev)
            else:
                if prev is not None:
                    prev.removed = True
                kept.append(Endpoint(spec=spec))
        for gone in old.values():
            gone.removed = True
        return EndpointSet(
            kept, version=version, source=source, declared=declared, adapters=adapters
        )
