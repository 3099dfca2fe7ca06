"""Keys, their usage and the routers' shares, held by the leading control plane.

:class:`Tenants` holds the keys (store kind ``apikey``), the usage book
(:mod:`llmgw_control.usage`) and what each router last reported, and serves two
calls of EndpointService:

- ``WatchKeys``: the whole key set (hashes only) on subscribe and again on every
  change; a create, update or revoke is stored, then sent at once.
- ``ReportUsage``: a router's usage since its last report is counted once (by its
  instance and sequence) and stored before the reply, which carries the router's
  share of each limited key (:mod:`llmgw_control.shares`) for :data:`VALID_FOR`.

Budget grants are stored with the usage (kind ``keygrants``), so a new leader knows
what the routers may still reserve; a grant counts as held until its router reports
again (or for :data:`GRANT_HOLD`), since a router cut off keeps what it was granted.
A standby holds nothing (the gate refuses both calls there) and reads everything
back when elected.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpclib.const
import grpclib.server
import msgspec
import structlog
from grpclib.exceptions import GRPCError
from llmgw_proto import v1
from prometheus_client import CollectorRegistry, Counter, Gauge

from llmgw_control import keys as keys_mod
from llmgw_control import shares
from llmgw_control.keys import KeyInputError, KeyRecord
from llmgw_control.store.keeper import StateKeeper
from llmgw_control.usage import GRANTS, SEEN, USAGE, Counts, UsageBook, instance_key
from llmgw_control.wire import recv

__all__ = ["ACTIVE", "GRANT_HOLD", "VALID_FOR", "KeyConflict", "Tenants"]

log = structlog.get_logger(__name__)

# How long a reply's shares hold at the router without a further reply.
VALID_FOR = 10.0
# A router that reported within this long shares in every key's limits.
ACTIVE = 5.0
# How long a router's budget grant counts as held when it does not report again: a
# router cut off keeps what it was granted (its next report replaces the grant; a
# restarted router reports under the same id), so its grant is not given to others
# before this.
GRANT_HOLD = 600.0
# How long ReportUsage waits for its counts to be stored before it replies anyway.
STORE_WAIT = 2.0
MAX_ID = 256

RouterCheck = Callable[[grpclib.server.Stream[Any, Any], str], None]


class KeyConflict(Exception):
    """A name taken (create), unknown (update, revoke), or a key revoked; HTTP 409/404."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class RouterSeen:
    at: float
    # key name -> (demand rpm, demand tpm, in flight)
    demand: dict[str, tuple[float, float, int]] = field(default_factory=dict)


class _Grants(msgspec.Struct):
    router: str
    until: float
    grants: dict[str, int]


class TenantMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(f"llmgw_control_key_{name}", doc, ["key"], registry=registry)

        self.requests = counter("requests", "Requests of a key, as its routers reported them.")
        self.prompt = counter("prompt_tokens", "Prompt tokens of a key's requests.")
        self.completion = counter("completion_tokens", "Completion tokens of a key's requests.")
        self.errors = counter("errors", "A key's requests that ended in an error.")
        self.refused = counter("refused", "A key's requests refused with 429 (limits, budget).")
        self.held = counter("held_seconds", "Seconds a key's requests were held in a queue.")
        self.budget_used = Gauge(
            "llmgw_control_key_budget_used_tokens",
            "Tokens of a key's budget used this period, fleet-wide.",
            ["key"],
            registry=registry,
        )
        self.routers = Gauge(
            "llmgw_control_key_routers",
            "Routers that reported usage within the last few seconds.",
            registry=registry,
        )
        self.keys = Gauge(
            "llmgw_control_keys", "Keys the control plane manages (revoked ones too).",
            registry=registry,
        )  # fmt: skip

    def count(self, name: str, c: Counts) -> None:
        self.requests.labels(name).inc(c.requests)
        self.prompt.labels(name).inc(c.prompt_tokens)
        self.completion.labels(name).inc(c.completion_tokens)
        self.errors.labels(name).inc(c.errors)
        self.refused.labels(name).inc(c.refused)
        self.held.labels(name).inc(c.held_seconds)


class Tenants:
    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        keeper: Callable[[], StateKeeper] | None = None,
        leading: Callable[[], bool] = lambda: True,
        check_router: RouterCheck | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.keys: dict[str, KeyRecord] = {}
        self.book = UsageBook()
        self.routers: dict[str, RouterSeen] = {}
        # router id -> (until, key -> tokens): budget grants outstanding.
        self.grants: dict[str, tuple[float, dict[str, int]]] = {}
        # (key, "rpm"|"tpm"|"concurrency") -> router -> (share, until): rate shares held.
        self.held: dict[tuple[str, str], dict[str, tuple[float, float]]] = {}
        self.version = int(time.time() * 1000)
        self._keeper = keeper
        self.leading = leading
        self.check_router = check_router
        self.clock = clock
        self.metrics = TenantMetrics(registry) if registry is not None else None
        self._subscribers: set[asyncio.Event] = set()
        self._key_set: v1.KeySet | None = None
        self._pruned_at = 0.0

    # --- the store ----------------------------------------------------------------------

    @property
    def keeper(self) -> StateKeeper | None:
        return self._keeper() if self._keeper is not None else None

    def _put(self, kind: str, key: str, value: bytes | None) -> None:
        keeper = self.keeper
        if keeper is not None:
            keeper.put(kind, key, value)

    async def _durable(self, timeout: float) -> bool:
        keeper = self.keeper
        return True if keeper is None else await keeper.durable(timeout)

    def restore(self, keeper: StateKeeper) -> None:
        """Take back the keys, usage and grants the store holds (start, takeover)."""
        self.keys = {}
        for name, data in keeper.records(keys_mod.KIND).items():
            try:
                self.keys[name] = keys_mod.decode(data)
            except (msgspec.DecodeError, TypeError) as err:
                log.error("unreadable key record skipped", key=name, error=str(err))
        self.book.restore(keeper.records(USAGE), keeper.records(SEEN))
        self.grants = {}
        for data in keeper.records(GRANTS).values():
            try:
                g = msgspec.json.decode(data, type=_Grants)
            except msgspec.DecodeError:
                continue
            self.grants[g.router] = (g.until, dict(g.grants))
        self.routers = {}
        self.held = {}
        self._changed()
        log.info("keys restored", keys=len(self.keys), grants=len(self.grants))

    def forget(self) -> None:
        """Standing by: hold nothing (read back when elected)."""
        self.keys = {}
        self.book = UsageBook()
        self.routers = {}
        self.grants = {}
        self.held = {}
        self._changed()

    def _changed(self) -> None:
        self.version = max(self.version + 1, int(time.time() * 1000))
        self._key_set = None
        if self.metrics is not None:
            self.metrics.keys.set(len(self.keys))
        for event in self._subscribers:
            event.set()

    # --- keys: create, update, revoke (the admin API) -----------------------------------

    def create(self, name: str, fields: dict[str, Any]) -> tuple[KeyRecord, str]:
        """A new key and its secret (shown once); KeyInputError, KeyConflict."""
        keys_mod.check_name(name)
        checked = keys_mod.check_fields(fields)
        existing = self.keys.get(name)
        if existing is not None:
            state = "revoked " if existing.revoked else ""
            raise KeyConflict(409, f"a {state}key named {name!r} exists; choose another name")
        secret = keys_mod.make_secret({k.prefix for k in self.keys.values()})
        record = keys_mod.apply_fields(None, name, checked, self.clock(), secret)
        self._keep(record)
        log.info("key created", key=name, prefix=record.prefix)
        return record, secret

    def update(self, name: str, fields: dict[str, Any]) -> KeyRecord:
        checked = keys_mod.check_fields(fields)
        existing = self._known(name)
        if existing.revoked:
            raise KeyConflict(409, f"key {name!r} is revoked; create a new one")
        if not checked:
            raise KeyInputError("nothing to change: give at least one setting (see --help)")
        record = keys_mod.apply_fields(existing, name, checked, self.clock())
        self._keep(record)
        log.info("key updated", key=name, changed=sorted(checked))
        return record

    def revoke(self, name: str) -> KeyRecord:
        existing = self._known(name)
        if existing.revoked:
            return existing
        record = keys_mod.apply_fields(existing, name, {"revoked": True}, self.clock())
        self._keep(record)
        log.info("key revoked", key=name, prefix=record.prefix)
        return record

    def _known(self, name: str) -> KeyRecord:
        keys_mod.check_name(name)
        existing = self.keys.get(name)
        if existing is None:
            raise KeyConflict(404, f"no key named {name!r} (see keys list)")
        return existing

    def _keep(self, record: KeyRecord) -> None:
        self.keys[record.name] = record
        self._put(keys_mod.KIND, record.name, keys_mod.encode(record))
        self._changed()

    async def stored(self, timeout: float = 5.0) -> bool:
        return await self._durable(timeout)

    # --- what is shown ------------------------------------------------------------------

    def period_used(self, key: KeyRecord, now: float) -> int:
        if not key.budget_period:
            return 0
        return self.book.tokens_since(key.name, keys_mod.period_start(key.budget_period, now))

    def listing(self) -> list[dict[str, Any]]:
        """Every key with its limits, usage this period (or the last day) and last use."""
        now = self.clock()
        out = []
        for name in sorted(self.keys):
            key = self.keys[name]
            since = (
                keys_mod.period_start(key.budget_period, now) if key.budget_period else now - 86400
            )
            counts = self.book.totals(since, [name])[name]
            last = self.book.last_used(name)
            out.append(
                {
                    **key.limits(),
                    "period": key.budget_period or "24h",
                    "usage": counts.as_json(),
                    "budget_used": counts.tokens if key.budget_period else 0,
                    "last_used": _iso(last) if last else None,
                    "created": _iso(key.created) if key.created else None,
                }
            )
        return out

    def usage(self, since_s: float, name: str | None = None) -> dict[str, Any]:
        now = self.clock()
        names = [name] if name is not None else sorted(self.keys)
        totals = self.book.totals(now - since_s, names)
        return {
            "since": _iso(now - since_s),
            "keys": [{"name": n, **totals[n].as_json()} for n in names],
        }

    def status(self) -> dict[str, Any]:
        """The status JSON's ``keys`` section."""
        now = self.clock()
        return {
            "version": self.version,
            "routers": sorted(r for r, s in self.routers.items() if s.at > now - ACTIVE),
            "keys": self.listing(),
        }

    # --- WatchKeys ----------------------------------------------------------------------

    def key_set(self) -> v1.KeySet:
        if self._key_set is None:
            self._key_set = v1.KeySet(
                version=self.version,
                keys=[self.keys[n].message() for n in sorted(self.keys)],
            )
        return self._key_set

    async def watch_keys(self, stream: grpclib.server.Stream[v1.WatchRequest, v1.KeySet]) -> None:
        request = await recv(stream, "key watch stream") or v1.WatchRequest()
        router_id = request.router_id
        if self.check_router is not None:
            self.check_router(stream, router_id)
        changed = asyncio.Event()
        self._subscribers.add(changed)
        log.info("router watches keys", router_id=router_id, keys=len(self.keys))
        try:
            sent = -1
            while True:
                changed.clear()
                if self.version != sent:
                    sent = self.version
                    await stream.send_message(self.key_set())
                await changed.wait()
        finally:
            self._subscribers.discard(changed)

    # --- ReportUsage --------------------------------------------------------------------

    async def report_usage(
        self, stream: grpclib.server.Stream[v1.UsageReport, v1.UsageReply]
    ) -> None:
        report = await recv(stream, "usage report") or v1.UsageReport()
        if self.check_router is not None:
            self.check_router(stream, report.router_id)
        problem = report_problem(report)
        if problem is not None:
            raise GRPCError(grpclib.const.Status.INVALID_ARGUMENT, problem)
        reply = self.report(report)
        # Counted and granted only once stored: a reply lost with a control plane
        # that died makes the router send the same report (sequence) again.
        if not await self._durable(STORE_WAIT):
            log.warning("usage not stored in time; replying anyway", router_id=report.router_id)
        await stream.send_message(reply)

    def report(self, report: v1.UsageReport) -> v1.UsageReply:
        """Count ``report`` (once) and the router's shares; the records are staged."""
        now = self.clock()
        router = report.router_id
        fresh = self.book.fresh(report.instance, report.sequence)
        deltas: list[tuple[str, Counts]] = []
        before = self.routers.get(router)
        seen = RouterSeen(at=now)
        wanted: dict[str, tuple[float, float, int]] = {}
        for u in report.usage:
            if u.key not in self.keys:
                continue  # a key of the router's own config: not counted here
            wanted[u.key] = (u.demand_rpm, u.demand_tpm, u.in_flight)
            c = Counts.clean(
                u.requests, u.prompt_tokens, u.completion_tokens, u.errors, u.refused,
                u.held_seconds, now,
            )  # fmt: skip
            if c != Counts():
                deltas.append((u.key, c))
        # Demand smoothed per router and key; a key it stopped reporting fades out.
        elapsed = now - before.at if before is not None else 0.0
        for name in wanted.keys() | (before.demand.keys() if before is not None else set()):
            if name not in self.keys:
                continue
            was = before.demand.get(name, (0.0, 0.0, 0)) if before is not None else None
            rpm, tpm, in_flight = wanted.get(name, (0.0, 0.0, 0))
            d = (
                shares.smooth(was[0] if was else None, rpm, elapsed),
                shares.smooth(was[1] if was else None, tpm, elapsed),
                in_flight,
            )
            if d[0] > 1e-3 or d[1] > 1e-3 or in_flight:
                seen.demand[name] = d
        self.routers[router] = seen
        if fresh:
            for kind, key, value in self.book.add(report.instance, report.sequence, deltas, now):
                self._put(kind, key, value)
            if self.metrics is not None:
                for name, c in deltas:
                    self.metrics.count(name, c)
        if now - self._pruned_at > 60:
            self._prune(now)
        reply = v1.UsageReply(
            shares=self._shares(router, now), valid_for=dt.timedelta(seconds=VALID_FOR)
        )
        return reply

    def _prune(self, now: float) -> None:
        self._pruned_at = now
        for kind, key, value in self.book.prune(now):
            self._put(kind, key, value)
        for r in [r for r, s in self.routers.items() if s.at < now - 10 * ACTIVE]:
            del self.routers[r]
        for ref in [ref for ref, held in self.held.items() if not _unexpired(held, now)]:
            del self.held[ref]
        for r in [r for r, (until, _) in self.grants.items() if until < now]:
            del self.grants[r]
            self._put(GRANTS, instance_key(r), None)

    def _shares(self, router: str, now: float) -> list[v1.KeyShare]:
        active = {r: s for r, s in self.routers.items() if s.at > now - ACTIVE or r == router}
        if self.metrics is not None:
            self.metrics.routers.set(len(active))
        out: list[v1.KeyShare] = []
        granted: dict[str, int] = {}
        for name in sorted(self.keys):
            key = self.keys[name]
            if key.revoked or not key.limited:
                continue
            rpm_d = {r: s.demand.get(name, (0.0, 0.0, 0))[0] for r, s in active.items()}
            tpm_d = {r: s.demand.get(name, (0.0, 0.0, 0))[1] for r, s in active.items()}
            share = v1.KeyShare(key=name)
            if key.rpm:
                target = shares.split(float(key.rpm), rpm_d)[router]
                share.rpm = self._hold(name, "rpm", router, target, key.rpm, now)
            if key.tpm:
                target = shares.split(float(key.tpm), tpm_d)[router]
                share.tpm = self._hold(name, "tpm", router, target, key.tpm, now)
            if key.max_concurrent:
                busy = {
                    r: s.demand.get(name, (0.0, 0.0, 0))[2] + rpm_d[r] / 60
                    for r, s in active.items()
                }
                whole = shares.split_whole(key.max_concurrent, busy)[router]
                held = self._hold(name, "concurrency", router, whole, key.max_concurrent, now)
                share.max_concurrent = math.floor(held)
            if key.budget_tokens:
                used = self.period_used(key, now)
                if self.metrics is not None:
                    self.metrics.budget_used.labels(name).set(used)
                others = {
                    r: g.get(name, 0)
                    for r, (until, g) in self.grants.items()
                    if until > now and r != router
                }
                share.budget_used = used
                share.budget_tokens = shares.grant(key.budget_tokens - used, router, tpm_d, others)
                granted[name] = share.budget_tokens
            out.append(share)
        if granted or router in self.grants:
            until = now + GRANT_HOLD
            self.grants[router] = (until, granted)
            value = msgspec.json.encode(_Grants(router, until, granted))
            self._put(GRANTS, instance_key(router), value)
        return out

    def _hold(
        self, name: str, dim: str, router: str, target: float, limit: int, now: float
    ) -> float:
        """``router``'s share of ``limit``: its target, within what the others' unexpired
        shares leave (:func:`llmgw_control.shares.bounded`); held for VALID_FOR."""
        held = self.held.setdefault((name, dim), {})
        others = {r: v for r, (v, until) in held.items() if r != router and until > now}
        value = shares.bounded(target, float(limit), others)
        held[router] = (value, now + VALID_FOR)
        for r in [r for r, (_, until) in held.items() if until <= now]:
            del held[r]
        return value

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            "/llmgw.v1.EndpointService/WatchKeys": grpclib.const.Handler(
                self.watch_keys,
                grpclib.const.Cardinality.UNARY_STREAM,
                v1.WatchRequest,
                v1.KeySet,
            ),
            "/llmgw.v1.EndpointService/ReportUsage": grpclib.const.Handler(
                self.report_usage,
                grpclib.const.Cardinality.UNARY_UNARY,
                v1.UsageReport,
                v1.UsageReply,
            ),
        }


def report_problem(report: v1.UsageReport) -> str | None:
    """Why a usage report cannot be taken; None if it can."""
    if not report.router_id or len(report.router_id) > MAX_ID:
        return f"router_id: 1 to {MAX_ID} characters, got {len(report.router_id)}"
    if not report.instance or len(report.instance) > MAX_ID:
        return f"instance: 1 to {MAX_ID} characters, got {len(report.instance)}"
    return None


def _unexpired(held: dict[str, tuple[float, float]], now: float) -> bool:
    return any(until > now for _, until in held.values())


def _iso(at: float) -> str:
    return dt.datetime.fromtimestamp(at, dt.UTC).isoformat(timespec="seconds")
