"""Keys and shares from the control plane (`EndpointService.WatchKeys`, `ReportUsage`).

On the channel the endpoint watcher holds to the control plane's leader (watch.py
starts both loops beside its Watch stream):

- ``WatchKeys``: the whole key set (names, prefixes, SHA-256 of the secrets, limits),
  each replacing the previous one. A router that loses the control plane keeps the
  last set it had.
- ``ReportUsage`` every `tenants.report_interval`: per key, what this router (this
  worker: each subscribes as its own router) admitted, used and refused since its
  last report, and its demand; the reply is this router's share of each key's limits,
  valid for `valid_for`. A report that got no reply is sent again unchanged (same
  ``instance`` and ``sequence``), so the control plane counts its deltas once; new
  usage waits for the next one.
"""

from __future__ import annotations

import asyncio
import secrets

import structlog
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError
from llmgw_proto.backoff import Backoff
from llmgw_proto.v1 import ApiKey as WireKey
from llmgw_proto.v1 import KeySet, KeyUsage, UsageReply, UsageReport, WatchRequest

from llmgw_router.config import ApiKey
from llmgw_router.state import now
from llmgw_router.tenants.gate import Share, Tenancy
from llmgw_router.tenants.limits import KeyLimits

__all__ = ["KeysClient", "key_from_wire"]

log = structlog.get_logger(__name__)

_WATCH_KEYS = "/llmgw.v1.EndpointService/WatchKeys"
_REPORT_USAGE = "/llmgw.v1.EndpointService/ReportUsage"


def key_from_wire(key: WireKey) -> ApiKey:
    return ApiKey(
        secret=b"",
        name=key.name,
        models=frozenset(key.models),
        limits=KeyLimits(
            rpm=float(key.rpm),
            tpm=float(key.tpm),
            max_concurrent=key.max_concurrent,
            budget_tokens=key.budget_tokens,
        ),
        priority=key.priority,
        weight=max(1, key.weight),
        budget_period=key.budget_period,
        prefix=key.prefix,
        sha256=key.sha256.lower(),
        local=False,
    )


class KeysClient:
    """The two key loops of one router process."""

    def __init__(
        self,
        tenancy: Tenancy,
        router_id: str,
        *,
        backoff: tuple[float, float] = (0.5, 30.0),
    ) -> None:
        self.tenancy = tenancy
        self.router_id = router_id
        self.instance = secrets.token_hex(8)
        self.sequence = 0
        self.pending: UsageReport | None = None
        self.backoff = Backoff(*backoff)
        self.reports = 0
        self._last_report = now()

    # ------------------------------------------------------------------ WatchKeys

    async def watch(self, channel: Channel) -> None:
        """Key sets until the channel goes; a refusal is retried with backoff."""
        while True:
            try:
                request = WatchRequest(
                    router_id=self.router_id, known_version=self.tenancy.keys_version
                )
                async with channel.request(
                    _WATCH_KEYS, Cardinality.UNARY_STREAM, WatchRequest, KeySet
                ) as stream:
                    await stream.send_message(request, end=True)
                    async for keyset in stream:
                        self.apply(keyset)
                        self.backoff.reset()
                reason = "stream ended"
            except GRPCError as err:
                reason = (
                    "the control plane does not serve WatchKeys"
                    if err.status is Status.UNIMPLEMENTED
                    else f"{err.status.name}: {err.message}"
                )
            except Exception as err:
                # The stream broke (the connection, h2): try again on this channel; the
                # session ends anyway when the Watch beside it sees the connection gone.
                reason = f"{type(err).__name__}: {err}"
            delay = self.backoff.next()
            log.warning(
                "key stream lost; keeping the last key set",
                reason=reason,
                retry_in=round(delay, 3),
                version=self.tenancy.keys_version,
            )
            await asyncio.sleep(delay)

    def apply(self, keyset: KeySet) -> None:
        keys = [key_from_wire(k) for k in keyset.keys if not k.revoked and k.prefix and k.sha256]
        self.tenancy.set_control_keys(keys, keyset.version)
        log.info("key set applied", version=keyset.version, keys=[k.name for k in keys])

    # ------------------------------------------------------------------ ReportUsage

    def next_report(self) -> UsageReport:
        """The report to send: the one not yet answered, else a new one of the usage since."""
        if self.pending is not None:
            return self.pending
        at = now()
        elapsed = max(1e-3, at - self._last_report)
        self._last_report = at
        tenancy = self.tenancy
        per_minute = 60.0 / elapsed
        usage = [
            KeyUsage(
                key=name,
                requests=u.requests,
                prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
                errors=u.errors,
                refused=u.refused,
                held_seconds=u.held_seconds,
                demand_rpm=u.asked * per_minute,
                demand_tpm=u.asked_tokens * per_minute,
                in_flight=tenancy.in_flight(name),
            )
            for name, u in tenancy.take_usage().items()
            if name
        ]
        # Keys with requests in flight but nothing new still say so (their demand holds).
        reported = {u.key for u in usage}
        for name, ks in tenancy.keys.items():
            if name not in reported and ks.in_flight:
                usage.append(KeyUsage(key=name, in_flight=ks.in_flight))
        self.sequence += 1
        self.pending = UsageReport(
            router_id=self.router_id, usage=usage, sequence=self.sequence, instance=self.instance
        )
        return self.pending

    def answered(self, reply: UsageReply) -> None:
        self.pending = None
        self.reports += 1
        valid_for = (
            reply.valid_for.total_seconds()
            if reply.valid_for is not None
            else 3 * self.tenancy.config.report_interval
        )
        self.tenancy.apply_shares(
            (
                (
                    share.key,
                    Share(
                        rpm=share.rpm,
                        tpm=share.tpm,
                        max_concurrent=share.max_concurrent,
                        budget_tokens=share.budget_tokens,
                    ),
                )
                for share in reply.shares
            ),
            valid_for,
        )

    async def report(self, channel: Channel) -> None:
        """Every report_interval: usage reported, shares applied; failures logged, retried."""
        interval = self.tenancy.config.report_interval
        while True:
            report = self.next_report()
            try:
                async with channel.request(
                    _REPORT_USAGE,
                    Cardinality.UNARY_UNARY,
                    UsageReport,
                    UsageReply,
                    timeout=max(1.0, 2 * interval),
                ) as stream:
                    await stream.send_message(report, end=True)
                    reply = await stream.recv_message()
                if reply is not None:
                    self.answered(reply)
            except GRPCError as err:
                if err.status is Status.UNIMPLEMENTED:
                    log.warning("the control plane does not serve ReportUsage; using fallbacks")
                    return
                log.warning("usage report failed", error=f"{err.status.name}: {err.message}")
            except Exception as err:
                # The report stays pending: sent again, unchanged, next time.
                log.warning("usage report failed", error=f"{type(err).__name__}: {err}")
            await asyncio.sleep(interval)
