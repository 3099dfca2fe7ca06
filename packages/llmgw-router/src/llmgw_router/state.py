"""What the proxy, the admin app, the health checks and the watcher share.

Apart from the proxy so that admin, health and watch do not import the request path.
One clock: every time here is ``time.monotonic()`` (see :func:`now`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import structlog

from llmgw_router.balancing import Balancer, make_balancer
from llmgw_router.budget import RetryBudget
from llmgw_router.config import RouterConfig
from llmgw_router.endpoints import CacheChange, Endpoint, EndpointSet, EngineLoad
from llmgw_router.lora import LoraBook
from llmgw_router.metrics import Metrics
from llmgw_router.outlier import (
    OutlierPolicy,
    in_panic,
    may_eject,
    record_failure,
    record_success,
)
from llmgw_router.tokens import PromptTokenizer, TokenCache

__all__ = ["ControlStatus", "RouterState", "now"]

log = structlog.get_logger(__name__)

# The router's one clock for deadlines, ejection, health and load ages.
now = time.monotonic


class ControlStatus:
    """Where the control plane stands, as the watcher last saw it (for 503 answers)."""

    __slots__ = ("address", "connected", "reason")

    def __init__(self, address: str) -> None:
        self.address = address
        self.connected = False
        # Why the last attempt failed; empty while none has.
        self.reason = ""


class RouterState:
    """The endpoint set and the live policy, shared by every part of the router."""

    def __init__(self, config: RouterConfig, endpoints: EndpointSet, metrics: Metrics) -> None:
        self.config = config
        # Swapped whole by one assignment when a new snapshot arrives.
        self.endpoints = endpoints
        self.metrics = metrics
        self.balancer: Balancer[Endpoint] = make_balancer(
            config.balancer, cache_aware=config.cache_aware
        )
        self.budget = RetryBudget(
            config.retries.budget_ratio, config.retries.budget_min_per_second, now=now()
        )
        # Precise matching: each model's tokenizer, loaded once and shared by the proxy
        # and /v1/match, and one cache of prompt segments' tokens for them all.
        self.token_cache = TokenCache(
            config.cache_aware.token_cache_bytes, on_use=self._count_tokens
        )
        self._tokenizers: dict[str, PromptTokenizer] = {}
        ejection = config.ejection
        self.outlier_policy = OutlierPolicy(
            consecutive_failures=ejection.consecutive_failures,
            base_time=ejection.base_time,
            max_time=ejection.max_time,
            max_ejection_percent=ejection.max_ejection_percent,
            panic_threshold=ejection.panic_threshold,
        )
        # Each endpoint's settings from this router's config (never class-wide: two router
        # states in one process keep their own).
        self._max_age = config.load_reports.max_age
        cache_aware = config.cache_aware
        self._block_tokens = cache_aware.block_bytes / cache_aware.bytes_per_token
        self.configure(endpoints)
        self.draining = False
        self.in_flight = 0
        # A router with a control plane has no snapshot until the first one arrives.
        self.has_snapshot = config.control is None
        self.control = ControlStatus(config.control.describe() if config.control else "")
        # Every model name this router has seen served or declared: a model known once
        # and without endpoints now is unavailable (503), not unknown (404).
        self.known_models: set[str] = set(endpoints.models)
        # Called after every swap (hold.py wakes its held requests).
        self.on_endpoints: list[Callable[[], None]] = []
        # Scale to zero: requests held per model, and who tells the control plane.
        self.held: dict[str, int] = {}
        self.on_demand: list[Callable[[str], None]] = []
        # LoRA adapters' requests, counted for demand reports (llmgw_router.lora).
        self.lora = LoraBook()
        # Tenants (tenants.gate.Tenancy), set by the proxy: the admin view reads it.
        self.tenants: Any = None

    def demand(self, model: str) -> None:
        for callback in self.on_demand:
            callback(model)

    # ------------------------------------------------------------------ precise matching

    def tokenizer(self, model: str) -> PromptTokenizer | None:
        """``model``'s tokenizer (cache_aware.tokenizers; loaded on first use, the config
        check loaded it once already); None for a model without one."""
        tokenizer = self._tokenizers.get(model)
        if tokenizer is None:
            folder = self.config.cache_aware.tokenizers.get(model)
            if folder is None:
                return None
            tokenizer = self._tokenizers[model] = PromptTokenizer(Path(folder), self.token_cache)
        return tokenizer

    def _count_tokens(self, cached: int, encoded: int) -> None:
        metrics = self.metrics
        if cached:
            metrics.child(metrics.token_cache_tokens, "cache").inc(cached)
        if encoded:
            metrics.child(metrics.token_cache_tokens, "encoded").inc(encoded)

    # ------------------------------------------------------------------ snapshots

    def configure(self, endpoints: EndpointSet) -> None:
        """Give ``endpoints`` this router's settings (load figures' max age, prefix block)."""
        max_age, block_tokens = self._max_age, self._block_tokens
        for ep in endpoints.endpoints:
            ep.max_age = max_age
            ep.block_tokens = block_tokens
        self.metrics.declare(endpoints.models, (ep.id for ep in endpoints.endpoints))

    def swap(self, endpoints: EndpointSet) -> None:
        self.configure(endpoints)
        self.endpoints = endpoints
        self.has_snapshot = True
        self.known_models.update(endpoints.models)
        self.known_models.update(endpoints.declared)
        self.metrics.snapshot_version.set(endpoints.version)
        for callback in self.on_endpoints:
            callback()

    def is_known(self, model: str) -> bool:
        return model in self.known_models

    # ------------------------------------------------------------------ load reports

    def apply_loads(self, loads: Iterable[tuple[str, EngineLoad | None]], full: bool) -> int:
        """Engine figures by endpoint id (None: unknown); a full update forgets the rest."""
        by_id = self.endpoints.by_id
        seen: set[str] = set()
        applied = 0
        for endpoint_id, load in loads:
            ep = by_id.get(endpoint_id)
            seen.add(endpoint_id)
            if ep is None:
                continue
            if load is not None and load.generation and load.generation < ep.generation:
                # A figure from the engine's previous process.
                continue
            if load is not None and load.generation > ep.generation:
                self.balancer.forget(ep.id)
            ep.report(load)
            applied += 1
        if full:
            for ep in self.endpoints.endpoints:
                if ep.id not in seen and ep.engine is not None:
                    ep.report(None)
        return applied

    def apply_caches(self, changes: Iterable[tuple[str, CacheChange]]) -> None:
        """Engine cache changes by endpoint id, each told to its endpoint (if still here)."""
        by_id = self.endpoints.by_id
        for endpoint_id, change in changes:
            ep = by_id.get(endpoint_id)
            if ep is not None:
                ep.cache_changed(change)

    def forget_loads(self) -> None:
        """The load stream is gone: every endpoint falls back to this router's counts."""
        for ep in self.endpoints.endpoints:
            if ep.engine is not None:
                ep.report(None)

    # ------------------------------------------------------------------ ejection

    def usable_among(self, candidates: Sequence[Endpoint], at: float) -> Callable[[Endpoint], bool]:
        """Which candidates the balancer may pick now; all healthy ones in panic."""
        usable = sum(1 for ep in candidates if ep.usable(at))
        live = [ep for ep in candidates if not ep.removed]
        if usable < len(live) and in_panic(usable, len(live), self.outlier_policy):
            self.metrics.child(self.metrics.panics, candidates[0].spec.models[0]).inc()

            def panic(ep: Endpoint) -> bool:
                return ep.healthy and not ep.removed

            return panic

        def normal(ep: Endpoint) -> bool:
            return ep.usable(at)

        return normal

    def _may_eject(self, ep: Endpoint, at: float) -> bool:
        endpoints = self.endpoints
        for model in ep.spec.models:
            peers = [e for e in (endpoints.for_model(model) or ()) if not e.removed]
            if ep not in peers:
                peers.append(ep)
            ejected = sum(1 for e in peers if e.outlier.ejected_until > at)
            if not may_eject(ejected, len(peers), self.outlier_policy):
                return False
        return True

    def record_failure(self, ep: Endpoint, reason: str) -> None:
        self.metrics.child(self.metrics.upstream_errors, ep.id, reason).inc()
        if reason == "status_429":
            # Busy is not broken: a 429 is retried elsewhere but never ejects.
            return
        at = now()
        before = ep.outlier.ejected_until
        allowed = self._may_eject(ep, at)
        ep.outlier = record_failure(ep.outlier, at, self.outlier_policy, allowed=allowed)
        if ep.outlier.ejected_until > at >= before:
            self.metrics.child(self.metrics.ejections, ep.id).inc()
            log.warning(
                "endpoint ejected",
                endpoint=ep.id,
                seconds=round(ep.outlier.ejected_until - at, 3),
                ejections=ep.outlier.ejections,
                reason=reason,
            )

    def record_success(self, ep: Endpoint) -> None:
        outlier = ep.outlier
        if outlier.consecutive_failures or outlier.ejections:
            ep.outlier = record_success(outlier, now(), self.outlier_policy)
