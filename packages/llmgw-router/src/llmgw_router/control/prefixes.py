"""The prefixes this router sees, shared with the fleet's routers (`SharePrefixes`,
issue 26).

With ``cache_aware.shared_homes`` each prefix's home is a rule computed from the recent
prefixes (balancing/placement.py). Each router of a fleet sees only its part of the
traffic; computed from its part, the homes differ between routers and a tenant is
cached on two engines. Every :data:`INTERVAL` seconds, on the channel the endpoint
watcher holds to the leader, this router sends the prefixes of its balancer's window
(each key with its size in blocks, its count and the endpoint this router last sent
it to, the largest counts first, at most :data:`MAX_KEYS`) and hands the reply, every
router's prefixes merged (with the endpoint most of their requests went to), to the
balancer (``CacheAware.share_keys``): a prefix the fleet holds has its home there, the
others are placed from the fleet's set. The balancer's window spans every model this
router serves, so the keys go under the model ``""``. When the control plane is out of
reach for :data:`STALE` seconds, or the session ends, the fleet's keys are dropped and
the router places from its own again. A router with static endpoints only has no
control plane: it never shares.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import structlog
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError
from llmgw_proto.v1 import ModelPrefixes, PrefixKey, PrefixReport, PrefixSet

from llmgw_router.balancing import CacheAware
from llmgw_router.state import now

__all__ = ["INTERVAL", "MAX_KEYS", "STALE", "PrefixSharer", "fleet_keys", "report_keys"]

log = structlog.get_logger(__name__)

_SHARE = "/llmgw.v1.EndpointService/SharePrefixes"
INTERVAL = 1.0
# The control plane refuses a report of more keys.
MAX_KEYS = 4096
# After this long without a reply the fleet's keys are dropped (the control plane's own
# reports expire after 10 s).
STALE = 10.0


def report_keys(keys: Mapping[int, tuple[int, int, str]], limit: int = MAX_KEYS) -> list[PrefixKey]:
    """``keys`` (key -> (size, count, holder)) as the report's, the largest counts first (equal:
    the smaller key), at most ``limit``; a key outside uint64 (none the hashes make) is
    left out."""
    fits = ((k, v) for k, v in keys.items() if 0 <= k < 2**64)
    ranked = sorted(fits, key=lambda kv: (-kv[1][1], kv[0]))[:limit]
    return [
        PrefixKey(key=key, size=min(size, 2**32 - 1), count=min(count, 2**32 - 1), holder=holder)
        for key, (size, count, holder) in ranked
    ]


def fleet_keys(reply: PrefixSet) -> dict[int, tuple[int, int, str]]:
    """The reply's keys over every model (this router's balancer has one window for all):
    a key in several models with the smallest known size, the counts summed and the
    holder of the larger count."""
    out: dict[int, tuple[int, int, str]] = {}
    for model in reply.models:
        for k in model.keys:
            was = out.get(k.key)
            if was is None:
                out[k.key] = (k.size, k.count, k.holder)
            else:
                least = min(was[0], k.size) if was[0] and k.size else was[0] or k.size
                holder = k.holder if k.holder and (k.count > was[1] or not was[2]) else was[2]
                out[k.key] = (least, was[1] + k.count, holder)
    return out


class PrefixSharer:
    """Shares ``balancer``'s recent prefixes every ``interval`` seconds (see the module)."""

    def __init__(
        self, balancer: CacheAware[Any], router_id: str, interval: float = INTERVAL
    ) -> None:
        self.balancer = balancer
        self.router_id = router_id
        self.interval = interval
        # How many routers the last reply's keys came from (0: none yet), for the admin.
        self.routers = 0

    def next_report(self) -> PrefixReport:
        return PrefixReport(
            router_id=self.router_id,
            models=[ModelPrefixes(model="", keys=report_keys(self.balancer.recent_keys()))],
        )

    async def share(self, channel: Channel) -> None:
        """Until cancelled (the session ended: the fleet's keys are dropped then); a
        control plane without SharePrefixes ends it quietly."""
        last_reply = now()
        failing = False
        try:
            while True:
                await asyncio.sleep(self.interval)
                try:
                    async with channel.request(
                        _SHARE,
                        Cardinality.UNARY_UNARY,
                        PrefixReport,
                        PrefixSet,
                        timeout=max(1.0, 2 * self.interval),
                    ) as stream:
                        await stream.send_message(self.next_report(), end=True)
                        reply = await stream.recv_message()
                except GRPCError as err:
                    if err.status is Status.UNIMPLEMENTED:
                        log.info("the control plane does not take SharePrefixes")
                        return
                    why = f"{err.status.name}: {err.message}"
                except Exception as err:
                    why = f"{type(err).__name__}: {err}"
                else:
                    if reply is not None:
                        self.balancer.share_keys(fleet_keys(reply))
                        self.routers = reply.routers
                        last_reply = now()
                        if failing:
                            log.info("sharing prefixes again")
                        failing = False
                        continue
                    why = "no reply"
                if not failing:
                    log.warning("prefix share failed", error=why)
                failing = True
                if now() - last_reply > STALE:
                    self.balancer.share_keys({})
                    self.routers = 0
        finally:
            self.balancer.share_keys({})
            self.routers = 0
