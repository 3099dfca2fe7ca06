"""Admission at the router: each key's limits, its share of fleet-wide limits, and the
fair-share queue when the engines are full. The pure parts are limits.py and fair.py;
this module holds them per key and per model, and reads the clock.

A request passes :meth:`Tenancy.admit` after routing (its model and candidates are
known) and before any engine sees it, and :meth:`Tenancy.done` when it ends, whatever
the outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Iterable
from typing import Any

import structlog

from llmgw_router.config import ApiKey
from llmgw_router.endpoints import Endpoint
from llmgw_router.errors import ApiError
from llmgw_router.state import RouterState, now
from llmgw_router.tenants.config import TenantsConfig
from llmgw_router.tenants.estimate import BYTES_PER_TOKEN, count_prompt, estimate_tokens
from llmgw_router.tenants.fair import FairQueue, Held
from llmgw_router.tenants.limits import KeyLimits, KeyState, Refusal, Reservation
from llmgw_router.tenants.metrics import TenantMetrics
from llmgw_router.tenants.parts import (
    Gate,
    Share,
    Ticket,
    Usage,
    enter,
    leave,
    lookup_secret,
    period_of,
    under_share,
)

__all__ = ["Share", "Tenancy", "Ticket", "Usage", "estimate_tokens", "lookup_secret"]

log = structlog.get_logger(__name__)


def _part(count: int, workers: int) -> int:
    """One worker's part of a router's ``count``: rounded up, so at least 1 when
    ``count`` is; 0 stays 0."""
    return -(-count // workers)


class Tenancy:
    """Per-key admission and the fair-share queue of one router process."""

    def __init__(self, state: RouterState, config: TenantsConfig, workers: int = 1) -> None:
        self.state = state
        self.config = config
        # Router-config limits are this router's; with N workers each takes 1/N.
        self.workers = max(1, workers)
        self.one_worker = self.workers == 1
        self.bands = {name: i for i, name in enumerate(config.bands)}
        self.default_band = self.bands[config.default_priority]
        self.queue_on = bool(config.queue.per_endpoint or config.queue.engine_waiting)
        # The queue's cap and headroom are this router's too: each worker's part,
        # rounded up (a set cap never drops to 0, which would mean none).
        self.cap = _part(config.queue.per_endpoint, self.workers)
        self.headroom = _part(config.queue.room, self.workers)
        # Models whose prompts are counted by their tokenizer (cache_aware.tokenizers).
        self.tokenizers = frozenset(state.config.cache_aware.tokenizers)
        self.keys: dict[str, KeyState] = {}
        self._periods: dict[str, str] = {}
        self._parts: dict[str, tuple[KeyLimits, KeyLimits]] = {}
        # Control-plane keys by prefix, and this router's shares of their limits.
        self.by_prefix: dict[str, ApiKey] = {}
        self.keys_version = 0
        self.closed = False
        self.shares: dict[str, Share] = {}
        self.shares_until = -math.inf
        self.usage: dict[str, Usage] = {}
        self.gates: dict[str, Gate] = {}
        self._ticker: asyncio.Task[None] | None = None
        self.metrics = TenantMetrics(state.metrics.registry, self.queue_lengths)

    # ------------------------------------------------------------------ keys, shares

    def set_control_keys(self, keys: Iterable[ApiKey], version: int) -> None:
        """The control plane's key set: replaces the previous one whole."""
        self.by_prefix = {k.prefix: k for k in keys if k.prefix and k.sha256}
        self.keys_version = version
        # Once the control plane has had a key, the router is closed: revoking the last
        # one must not open it to everyone.
        self.closed = self.closed or bool(self.by_prefix)

    def apply_shares(self, shares: Iterable[tuple[str, Share]], valid_for: float) -> None:
        at = now()
        self.shares = dict(shares)
        self.shares_until = at + valid_for
        for name, share in self.shares.items():
            ks = self.keys.get(name)
            if ks is not None and ks.limits.budget_tokens:
                ks.grant(share.budget_tokens)

    def limits_for(self, key: ApiKey, at: float) -> KeyLimits:
        """What this router may admit of ``key`` now."""
        limits = key.limits
        if key.local:
            if self.workers == 1:
                return limits
            # This worker's part, computed once per limits (not per request).
            memo = self._parts.get(key.name)
            if memo is None or memo[0] is not limits:
                memo = self._parts[key.name] = (limits, limits.scaled(1 / self.workers))
            return memo[1]
        share = self.shares.get(key.name) if at < self.shares_until else None
        if share is None:
            return limits.scaled(self.config.fallback_fraction / self.workers)
        return KeyLimits(
            rpm=max(1.0, share.rpm) if limits.rpm else 0.0,
            tpm=max(1.0, share.tpm) if limits.tpm else 0.0,
            max_concurrent=max(1, share.max_concurrent) if limits.max_concurrent else 0,
            budget_tokens=limits.budget_tokens,
        )

    def _state_for(self, key: ApiKey, at: float) -> KeyState:
        limits = self.limits_for(key, at)
        ks = self.keys.get(key.name)
        if ks is None:
            ks = self.keys[key.name] = KeyState(limits, at)
            # A budget: a router-config key's is its own (its workers' part); a
            # control-plane key's comes as grants with the shares.
            share = self.shares.get(key.name)
            ks.grant(
                share.budget_tokens
                if not key.local and share is not None
                else (limits.budget_tokens // self.workers if key.local else 0)
            )
        elif ks.limits is not limits and ks.limits != limits:
            ks.set_limits(limits, at)
        if key.local and limits.budget_tokens:
            period = period_of(key.budget_period, time.time())
            if self._periods.setdefault(key.name, period) != period:
                self._periods[key.name] = period
                ks.new_period(limits.budget_tokens // self.workers)
        return ks

    # ------------------------------------------------------------------ admission

    async def admit(
        self,
        key: ApiKey | None,
        model: str,
        candidates: tuple[Endpoint, ...],
        body: bytes,
        head: Any = None,
        tokens: Any = None,
    ) -> Ticket:
        """Admit a request, or raise ApiError (429 over a limit, 503 held too long).
        ``head``: the parse stage's (its max_tokens fields), None to read them from
        ``body``; ``tokens``: the prompt's tokens if the balancer counted them."""
        at = now()
        name = key.name if key is not None else ""
        band = self.default_band
        ks: KeyState | None = None
        reservation: Reservation | None = None
        usage = self.usage.get(name)
        if usage is None:
            usage = self.usage[name] = Usage()
        usage.asked += 1
        if key is not None:
            if key.priority in self.bands:
                band = self.bands[key.priority]
            limits = key.limits
            if limits.limited:
                ks = self.keys.get(name)
                # A router-config key of one worker, no budget, its state made for these
                # very limits: nothing in _state_for to do (the hot path).
                if (
                    ks is None
                    or ks.limits is not limits
                    or not key.local
                    or not self.one_worker
                    or limits.budget_tokens
                ):
                    ks = self._state_for(key, at)
                    limits = ks.limits
                need = 0
                if (limits.tpm or limits.budget_tokens) and (
                    tokens is None and head is not None and model not in self.tokenizers
                ):
                    # estimate_tokens, inline for the common case (the parse stage's head,
                    # no count of the prompt's tokens): the body's size, the bound.
                    completion = head.max_completion_tokens
                    if type(completion) is not int or completion < 0:
                        completion = head.max_tokens
                        if type(completion) is not int or completion < 0:
                            completion = self.config.default_max_tokens
                    need = len(body) // BYTES_PER_TOKEN + completion
                elif limits.tpm or limits.budget_tokens:
                    prompt: int | None = None
                    if tokens is not None:
                        prompt = len(tokens.tokens)
                    elif model in self.tokenizers:
                        tokenizer = self.state.tokenizer(model)
                        if tokenizer is not None:
                            prompt = await count_prompt(tokenizer, body)
                    need = estimate_tokens(
                        body, self.config.default_max_tokens, head=head, prompt_tokens=prompt
                    )
                usage.asked_tokens += need
                got = ks.try_reserve(need, at)
                if isinstance(got, Refusal):
                    usage.refused += 1
                    self.metrics.child(self.metrics.refused, name, got.limit).inc()
                    raise self._refusal(key, ks, got, at)
                reservation = got
        ticket = Ticket(
            name, self.config.bands[band], model, ks, reservation, self.queue_on, level=band
        )
        if self.queue_on:
            gate = self.gates.get(model)
            if gate is None:
                gate = self._gate(model, candidates)
            else:
                gate.candidates = candidates
            try:
                # self.full's own first test, inline: under one endpoint's cap, not full.
                if gate.queue.size or (
                    (gate.in_flight >= self.cap or self.config.queue.engine_waiting)
                    and self.full(gate, at, band)
                ):
                    await self._through_gate(ticket, band, key, candidates)
                else:
                    # The engines take it: no wait (the hot path; enter, inline).
                    gate.in_flight += 1
                    gate.by_band[band] += 1
                    by_key = gate.by_key
                    by_key[name] = by_key.get(name, 0) + 1
                    ticket.gate = gate
            except BaseException:
                ticket.gated = False
                self.done(ticket, None, None, 0)
                raise
        self.metrics.child(self.metrics.requests, name).inc()
        usage.requests += 1
        return ticket

    def _refusal(self, key: ApiKey, ks: KeyState, refusal: Refusal, at: float) -> ApiError:
        retry = refusal.retry_after
        retry_after = b"%d" % max(1, math.ceil(min(retry, 3600.0)))
        log.info(
            "request refused by admission",
            key=key.name,
            limit=refusal.limit,
            retry_after=retry_after.decode(),
        )
        budget = refusal.limit == "budget"
        return ApiError(
            429,
            f"API key {key.name!r}: {refusal.message}",
            "insufficient_quota" if budget else "rate_limit_error",
            code="insufficient_quota" if budget else "rate_limit_exceeded",
            headers=[(b"retry-after", retry_after), *ks.headers(at)],
        )

    def headers(self, ticket: Ticket) -> list[tuple[bytes, bytes]]:
        """The x-ratelimit-* headers for an admitted request's response."""
        return ticket.state.headers(now()) if ticket.state is not None else []

    def error_headers(self, err: ApiError, key: ApiKey | None) -> None:
        """A limited key's x-ratelimit-* headers added to an error answer (unless it
        has them: an admission refusal)."""
        if key is None or not key.limits.limited:
            return
        if any(name.startswith(b"x-ratelimit-") for name, _ in err.headers):
            return
        at = now()
        err.headers = [*err.headers, *self._state_for(key, at).headers(at)]

    def done(
        self,
        ticket: Ticket,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        status: int,
    ) -> None:
        """The request ended: reservations corrected, usage counted, the gate let go."""
        if ticket.done:
            return
        ticket.done = True
        at = now()
        name = ticket.key
        known = prompt_tokens is not None and completion_tokens is not None
        used = (prompt_tokens or 0) + (completion_tokens or 0) if known else None
        ks, reservation = ticket.state, ticket.reservation
        if ks is not None and reservation is not None:
            if reservation.done or reservation.budget:
                ks.release(reservation, used, at)
            else:
                # KeyState.release, inline for a reservation without a budget (every
                # request of a key with rates only).
                reservation.done = True
                ks.in_flight -= 1
                bucket = ks.tokens
                reserved = reservation.tokens
                if bucket is not None and used is not None and used != reserved:
                    if at > bucket.at:
                        level = bucket.level + (at - bucket.at) * bucket.rate
                        bucket.level = level if level < bucket.capacity else bucket.capacity
                        bucket.at = at
                    level = bucket.level + reserved - used
                    bucket.level = level if level < bucket.capacity else bucket.capacity
        usage = self.usage.get(name)
        if usage is None:
            # Admitted before the last usage report was taken: its usage is in the next.
            usage = self.usage[name] = Usage()
        if known:
            usage.prompt_tokens += prompt_tokens or 0
            usage.completion_tokens += completion_tokens or 0
            m = self.metrics
            m.child(m.tokens, name, "prompt").inc(prompt_tokens or 0)
            m.child(m.tokens, name, "completion").inc(completion_tokens or 0)
        if status >= 400:
            usage.errors += 1
            self.metrics.child(self.metrics.errors, name).inc()
        if ticket.gated:
            ticket.gated = False
            gate = ticket.gate or self.gates.get(ticket.model)
            if gate is not None:
                # leave, inline (every request of a queue-enabled router).
                gate.in_flight -= 1
                gate.by_band[ticket.level] -= 1
                by_key = gate.by_key
                left = by_key.get(name, 0) - 1
                if left > 0:
                    by_key[name] = left
                else:
                    by_key.pop(name, None)
                if gate.queue.size:
                    self._drain(gate)

    # ------------------------------------------------------------------ the queue

    def _gate(self, model: str, candidates: tuple[Endpoint, ...]) -> Gate:
        gate = self.gates.get(model)
        if gate is None:
            bands = len(self.bands)
            gate = self.gates[model] = Gate(FairQueue(bands), by_band=[0] * bands)
        gate.candidates = candidates
        return gate

    def full(self, gate: Gate, at: float, band: int = 0, key: str | None = None) -> bool:
        """The model's engines take no more of ``band`` (for ``key``) now: this worker's
        cap per endpoint (its part of the router's), or every engine reporting requests
        waiting. A band above one with requests in flight, and a key below its equal
        share of the cap, may go `headroom` (this worker's part) past it."""
        queue = self.config.queue
        cap = self.cap
        if gate.in_flight < cap and not queue.engine_waiting:
            return False  # under the cap of one endpoint: under any room (the hot path)
        candidates = gate.candidates
        usable = [ep for ep in candidates if ep.usable(at)] or list(candidates)
        if not usable:
            return False
        if cap:
            room = cap * len(usable)
            headroom = self.headroom
            if headroom and (
                any(gate.by_band[band + 1 :]) or (key is not None and under_share(gate, key, room))
            ):
                room += headroom * len(usable)
            if gate.in_flight >= room:
                return True
        if queue.engine_waiting:
            for ep in usable:
                engine = ep.fresh_engine(at)
                if engine is None:
                    return False
                since = ep.sent_since_report - ep.finished_since_report
                if engine.waiting + max(0, since) < queue.engine_waiting:
                    return False
            return True
        return False

    async def _through_gate(
        self, ticket: Ticket, band: int, key: ApiKey | None, candidates: tuple[Endpoint, ...]
    ) -> None:
        gate = self._gate(ticket.model, candidates)
        at = now()
        queue = gate.queue
        name = ticket.key
        if not len(queue):
            if not self.full(gate, at, band):
                enter(gate, name, band)
                return
        elif self.headroom:
            # Others held: a key below its share may still go into the headroom, unless a
            # higher band is waiting.
            first = queue.next_band()
            if first is not None and first >= band and not self.full(gate, at, band, name):
                enter(gate, name, band)
                return
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        weight = float(key.weight) if key is not None else 1.0
        held = gate.queue.push(future, band, ticket.key, weight)
        gate.waiters[id(future)] = (held, at)
        if len(gate.queue) > self.config.queue.max_held:
            victim = gate.queue.shed()
            if victim is not None:
                gate.waiters.pop(id(victim.item), None)
                if not victim.item.done():
                    victim.item.set_exception(self._overloaded(ticket.model, "shed", victim))
        self._drain(gate)
        self._tick()
        try:
            async with asyncio.timeout(self.config.queue.max_wait):
                await future
        except BaseException as err:
            if future.done() and not future.cancelled() and future.exception() is None:
                # Let go by _drain (and counted in flight) just as it timed out or the
                # client left: not going after all.
                leave(gate, name, ticket.level)
                self._drain(gate)
            if isinstance(err, TimeoutError):
                raise self._overloaded(ticket.model, "queue_timeout", held) from None
            raise
        finally:
            if gate.waiters.pop(id(future), None) is not None:
                gate.queue.remove(held)
            ticket.held = now() - at
            m = self.metrics
            m.child(m.wait, ticket.band, ticket.key).observe(ticket.held)
            m.child(m.held_seconds, ticket.key).inc(ticket.held)
            usage = self.usage.get(ticket.key)
            if usage is not None:
                usage.held_seconds += ticket.held
        # Counted by _drain when it let this one go.

    def _overloaded(self, model: str, why: str, held: Held[Any]) -> ApiError:
        self.metrics.child(self.metrics.refused, held.key, why).inc()
        message = (
            f"the engines for model `{model}` are full and the queue is over its bound"
            if why == "shed"
            else f"the engines for model `{model}` stayed full for {self.config.queue.max_wait:g}s"
        )
        return ApiError(
            503,
            message,
            "service_unavailable_error",
            param="model",
            code="overloaded",
            headers=[(b"retry-after", b"2")],
        )

    def _drain(self, gate: Gate) -> None:
        """Let held requests go, best first, while the engines take them."""
        queue = gate.queue
        if not len(queue):
            return
        at = now()
        while True:
            best = queue.peek()
            # The best held request cannot go: a lower band could not either.
            if best is None or self.full(gate, at, best.band, best.key):
                break
            held = queue.pop()
            if held is None:
                break
            gate.waiters.pop(id(held.item), None)
            if held.item.done():
                continue
            enter(gate, held.key, held.band)
            held.item.set_result(None)

    def _tick(self) -> None:
        """While anything is held, look again every 50 ms (engines' reports change)."""
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.create_task(self._tick_loop())

    async def _tick_loop(self) -> None:
        while any(len(g.queue) for g in self.gates.values()):
            await asyncio.sleep(0.05)
            for gate in self.gates.values():
                self._drain(gate)

    # ------------------------------------------------------------------ views

    def queue_lengths(self) -> dict[tuple[str, str], int]:
        out: dict[tuple[str, str], int] = {}
        names = self.config.bands
        for gate in self.gates.values():
            for band, per_key in enumerate(gate.queue.lengths()):
                for key, count in per_key.items():
                    label = (names[band], key)
                    out[label] = out.get(label, 0) + count
        return out

    def view(self) -> dict[str, Any]:
        """For the admin endpoints view: held requests and waits, keys' limits now."""
        at = now()
        return {
            "keys_version": self.keys_version,
            "control_keys": len(self.by_prefix),
            "shares_valid_for": round(max(0.0, self.shares_until - at), 3)
            if self.shares_until > -math.inf
            else None,
            "queues": {
                model: {
                    "in_flight": gate.in_flight,
                    "full": self.full(gate, at),
                    "held": [
                        {"priority": self.config.bands[b], "keys": per_key}
                        for b, per_key in enumerate(gate.queue.lengths())
                        if per_key
                    ],
                    "oldest_wait": round(
                        max((at - since for _, since in gate.waiters.values()), default=0.0),
                        3,
                    ),
                }
                for model, gate in self.gates.items()
            },
            "keys": {
                name: {
                    "in_flight": ks.in_flight,
                    "rpm": ks.limits.rpm or None,
                    "tpm": ks.limits.tpm or None,
                    "max_concurrent": ks.limits.max_concurrent or None,
                    "budget_left": ks.budget_left if ks.limits.budget_tokens else None,
                }
                for name, ks in self.keys.items()
            },
        }

    def take_usage(self) -> dict[str, Usage]:
        """Usage since the last call, per key; the counts start again."""
        taken, self.usage = self.usage, {}
        for ks in self.keys.values():
            ks.reported()
        return taken

    def in_flight(self, name: str) -> int:
        ks = self.keys.get(name)
        return ks.in_flight if ks is not None else 0

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(BaseException):
                await self._ticker
