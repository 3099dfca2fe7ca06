"""The engines' latest load and cache figures per endpoint, and what each router still needs.

Agents send ``LoadReport`` (figures that changed, per shard) and ``CacheEvents`` (prefix
cache blocks stored or evicted) up their streams. :class:`LoadBook` keeps the latest
figures per shard, maps the shards that lead a published endpoint to that endpoint,
and tracks per subscribed router which endpoints changed since its last update, so
the ``WatchLoad`` stream can send a full picture on subscribe and then coalesced
changes. Nothing here touches the endpoint snapshots: a load change never bumps
their version.

Freshness: an agent sends only changes, so unchanged figures are confirmed by every
later message of their node (heartbeats included). ``age`` is the time since the
node last confirmed them; figures of a node that went silent age, and a router
treats figures older than a few load intervals as unknown.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmgw_proto import v1

__all__ = ["Figures", "LoadBook", "Subscriber"]

# Blocks remembered per engine: beyond this the set is dropped and routers told to
# clear (a wrong "cached" guess costs a cache miss, never a wrong answer).
MAX_BLOCKS = 200_000
# Figures of a shard that leads no endpoint are forgotten after this long.
UNMAPPED_TTL = 120.0


@dataclass
class Figures:
    """One engine's last reported load."""

    node_id: str
    known: bool
    running: int
    waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    # The agent's generation of the engine process: a change means an empty cache.
    agent_generation: int
    at: float
    # The engine's KV cache in tokens (0: it does not say).
    cache_tokens: int = 0
    # The LoRA adapters the engine holds (issue 30).
    adapters: tuple[str, ...] = ()
    # Its prefill rate in prompt tokens per second, as its agent learned it (0: not yet).
    prefill_tokens_per_second: float = 0.0

    def as_json(self, age: float) -> dict[str, Any]:
        return {
            "known": self.known,
            "running": self.running,
            "waiting": self.waiting,
            "kv_cache_usage": round(self.kv_cache_usage, 4),
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "cache_tokens": self.cache_tokens,
            "prefill_tokens_per_second": round(self.prefill_tokens_per_second, 1),
            "adapters": list(self.adapters),
            "age": round(age, 3),
        }


@dataclass
class _Cache:
    blocks: set[int] = field(default_factory=set)
    block_size: int = 0
    # The blocks are named by their token ids (llmgw_proto.token_blocks).
    token_hashes: bool = False


@dataclass(eq=False)
class Subscriber:
    """One router's WatchLoad stream: which endpoints changed since its last update."""

    router_id: str
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    dirty: set[str] = field(default_factory=set)
    # endpoint id -> cache changes not yet sent, in order.
    caches: dict[str, list[v1.EndpointCache]] = field(default_factory=dict)


class LoadBook:
    def __init__(self) -> None:
        self._figures: dict[str, Figures] = {}
        self._caches: dict[str, _Cache] = {}
        # endpoint id -> (leader shard id, endpoint generation), as published.
        self._endpoints: dict[str, tuple[str, int]] = {}
        self._by_shard: dict[str, str] = {}
        # node id -> when it last said anything (confirms its unchanged figures).
        self._heard: dict[str, float] = {}
        self.subscribers: set[Subscriber] = set()
        # LoRA adapters not to tell routers an endpoint holds (being unloaded there):
        # endpoint id -> names (set by llmgw_control.lora).
        self.hidden_adapters: Callable[[str], frozenset[str]] = lambda endpoint_id: frozenset()

    # --- from agents ------------------------------------------------------------------

    def heard(self, node_id: str, now: float) -> None:
        self._heard[node_id] = now

    def report(self, node_id: str, msg: v1.LoadReport, now: float) -> None:
        self._heard[node_id] = now
        for e in msg.engines:
            old = self._figures.get(e.shard_id)
            if old is not None and old.agent_generation != e.generation:
                # Another engine process behind the same shard: its cache starts empty.
                self._cache_event(
                    e.shard_id, v1.CacheEvents(shard_id=e.shard_id, cleared=True), notify=True
                )
            self._figures[e.shard_id] = Figures(
                node_id,
                e.known,
                e.running,
                e.waiting,
                e.kv_cache_usage,
                e.prefix_cache_queries,
                e.prefix_cache_hits,
                e.generation,
                now,
                e.cache_tokens,
                tuple(sorted(e.adapters)),
                e.prefill_tokens_per_second,
            )
            self._touch(e.shard_id)

    def cache_events(self, node_id: str, msg: v1.CacheEvents, now: float) -> None:
        self._heard[node_id] = now
        self._cache_event(msg.shard_id, msg, notify=True)

    def _cache_event(self, shard_id: str, msg: v1.CacheEvents, *, notify: bool) -> None:
        cache = self._caches.setdefault(shard_id, _Cache())
        cleared = msg.cleared
        if cleared:
            cache.blocks.clear()
        if msg.block_size:
            cache.block_size = msg.block_size
        if cleared or msg.stored:
            cache.token_hashes = msg.token_hashes
        cache.blocks.difference_update(msg.removed)
        cache.blocks.update(msg.stored)
        stored, removed = list(msg.stored), list(msg.removed)
        if len(cache.blocks) > MAX_BLOCKS:
            cache.blocks = set(msg.stored)
            cleared, removed = True, []
        endpoint_id = self._by_shard.get(shard_id)
        if endpoint_id is None or not notify:
            return
        change = v1.EndpointCache(
            endpoint_id=endpoint_id,
            stored=stored,
            removed=removed,
            cleared=cleared,
            block_size=cache.block_size,
            generation=self._endpoints[endpoint_id][1],
            token_hashes=cache.token_hashes,
        )
        for sub in self.subscribers:
            sub.caches.setdefault(endpoint_id, []).append(change)
            sub.changed.set()

    def touch_endpoint(self, endpoint_id: str) -> None:
        """Send the endpoint's figures again (what routers may be told it holds changed)."""
        for sub in self.subscribers:
            sub.dirty.add(endpoint_id)
            sub.changed.set()

    def _touch(self, shard_id: str) -> None:
        endpoint_id = self._by_shard.get(shard_id)
        if endpoint_id is None:
            return
        for sub in self.subscribers:
            sub.dirty.add(endpoint_id)
            sub.changed.set()

    # --- from the publisher -----------------------------------------------------------

    def set_endpoints(self, endpoints: Mapping[str, tuple[str, int]], now: float) -> None:
        """The published endpoints: endpoint id -> (leader shard id, generation)."""
        if endpoints == self._endpoints:
            return
        changed = {
            eid
            for eid in set(endpoints) | set(self._endpoints)
            if endpoints.get(eid) != self._endpoints.get(eid)
        }
        gone_shards = {
            shard for eid, (shard, _) in self._endpoints.items() if eid not in endpoints
        } - {shard for shard, _ in endpoints.values()}
        self._endpoints = dict(endpoints)
        self._by_shard = {shard: eid for eid, (shard, _) in endpoints.items()}
        # An endpoint that went away takes its figures with it.
        for shard in gone_shards:
            self._figures.pop(shard, None)
            self._caches.pop(shard, None)
        for shard in [
            s
            for s, f in self._figures.items()
            if s not in self._by_shard and now - f.at > UNMAPPED_TTL
        ]:
            del self._figures[shard]
            self._caches.pop(shard, None)
        for sub in self.subscribers:
            sub.dirty.update(changed)
            for eid in changed:
                # A new endpoint (or a new engine behind it) starts from its full cache.
                sub.caches.pop(eid, None)
                if eid in endpoints:
                    sub.caches[eid] = [self._full_cache(eid)]
            if changed:
                sub.changed.set()

    # --- to routers -------------------------------------------------------------------

    def subscribe(self, router_id: str) -> Subscriber:
        sub = Subscriber(router_id)
        self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)

    def full(self, sub: Subscriber, now: float) -> v1.LoadUpdate:
        """Everything known, replacing what the router holds; resets its pending changes."""
        sub.dirty.clear()
        sub.caches.clear()
        sub.changed.clear()
        return v1.LoadUpdate(
            full=True,
            loads=[self._load(eid, now) for eid in sorted(self._endpoints)],
            caches=[
                self._full_cache(eid)
                for eid in sorted(self._endpoints)
                if self._caches.get(self._endpoints[eid][0])
            ],
        )

    def take(self, sub: Subscriber, now: float, *, refresh: bool = False) -> v1.LoadUpdate | None:
        """The changes since the router's last update (every endpoint on ``refresh``)."""
        ids = set(self._endpoints) if refresh else set(sub.dirty)
        sub.dirty.clear()
        caches = [c for eid in sorted(sub.caches) for c in sub.caches[eid]]
        sub.caches.clear()
        sub.changed.clear()
        if not ids and not caches:
            return None
        return v1.LoadUpdate(
            full=False, loads=[self._load(eid, now) for eid in sorted(ids)], caches=caches
        )

    def _load(self, endpoint_id: str, now: float) -> v1.EndpointLoad:
        entry = self._endpoints.get(endpoint_id)
        if entry is None:  # gone: the router forgets its figures
            return v1.EndpointLoad(endpoint_id=endpoint_id, known=False)
        shard_id, generation = entry
        f = self._figures.get(shard_id)
        if f is None:
            return v1.EndpointLoad(endpoint_id=endpoint_id, known=False, generation=generation)
        return v1.EndpointLoad(
            endpoint_id=endpoint_id,
            known=f.known,
            running=f.running,
            waiting=f.waiting,
            kv_cache_usage=f.kv_cache_usage,
            prefix_cache_queries=f.prefix_cache_queries,
            prefix_cache_hits=f.prefix_cache_hits,
            generation=generation,
            age=dt.timedelta(seconds=max(self.age(f, now), 0.0)),
            cache_tokens=f.cache_tokens,
            prefill_tokens_per_second=f.prefill_tokens_per_second,
            adapters=sorted(set(f.adapters) - self.hidden_adapters(endpoint_id)),
        )

    def _full_cache(self, endpoint_id: str) -> v1.EndpointCache:
        shard_id, generation = self._endpoints[endpoint_id]
        cache = self._caches.get(shard_id, _Cache())
        return v1.EndpointCache(
            endpoint_id=endpoint_id,
            stored=sorted(cache.blocks),
            cleared=True,
            block_size=cache.block_size,
            generation=generation,
            token_hashes=cache.token_hashes,
        )

    # --- for status and autoscaling -----------------------------------------------------

    def age(self, f: Figures, now: float) -> float:
        return now - max(f.at, self._heard.get(f.node_id, f.at))

    def figures(self, endpoint_id: str) -> Figures | None:
        entry = self._endpoints.get(endpoint_id)
        return self._figures.get(entry[0]) if entry is not None else None

    def as_json(self, now: float) -> dict[str, dict[str, Any]]:
        out = {}
        for eid, (shard_id, _) in self._endpoints.items():
            f = self._figures.get(shard_id)
            if f is not None:
                out[eid] = f.as_json(self.age(f, now))
        return out
