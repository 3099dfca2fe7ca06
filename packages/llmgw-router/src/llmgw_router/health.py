"""Active health checks: `GET <url><health_path>` on every endpoint, on a timer.

An endpoint is marked unhealthy after `unhealthy_threshold` failed probes in a row
and healthy again after `healthy_threshold` good ones; the balancers skip it
meanwhile. Probes of one round run concurrently, so one hung engine does not delay
the verdict on the others.
"""

from __future__ import annotations

import asyncio

import aiohttp
import structlog

from llmgw_router.config import HealthCheckConfig
from llmgw_router.endpoints import Endpoint
from llmgw_router.state import RouterState

__all__ = ["HealthChecker", "apply_probe"]

log = structlog.get_logger(__name__)


def apply_probe(ep: Endpoint, ok: bool, cfg: HealthCheckConfig) -> bool | None:
    """Record one probe result; the new health when it changed, else None."""
    if ok:
        ep.health_failures = 0
        ep.health_successes += 1
        if not ep.healthy and ep.health_successes >= cfg.healthy_threshold:
            ep.healthy = True
            return True
    else:
        ep.health_successes = 0
        ep.health_failures += 1
        if ep.healthy and ep.health_failures >= cfg.unhealthy_threshold:
            ep.healthy = False
            return False
    return None


class HealthChecker:
    def __init__(self, state: RouterState, session: aiohttp.ClientSession) -> None:
        self.state = state
        self.session = session
        self.cfg = state.config.health_checks
        self._timeout = aiohttp.ClientTimeout(total=self.cfg.timeout)

    async def _probe(self, ep: Endpoint) -> None:
        try:
            # The engine's secret too: not every engine leaves its health route open.
            auth = {"Authorization": f"Bearer {ep.spec.api_key}"} if ep.spec.api_key else None
            async with self.session.get(
                ep.url + (ep.spec.health_path or "/health"), timeout=self._timeout, headers=auth
            ) as resp:
                await resp.read()
                ok = resp.status == 200
                detail = f"status {resp.status}"
        except Exception as err:
            # aiohttp's errors and timeouts, and anything else a bad endpoint URL raises
            # (ValueError, InvalidURL): the probe failed; the checker goes on (issue 24.7).
            ok = False
            detail = f"{type(err).__name__}: {err}"
        changed = apply_probe(ep, ok, self.cfg)
        if changed is True:
            log.info("endpoint healthy again", endpoint=ep.id)
        elif changed is False:
            log.warning("endpoint unhealthy", endpoint=ep.id, detail=detail)

    async def run(self) -> None:
        while True:
            endpoints = self.state.endpoints.endpoints
            if endpoints:
                await asyncio.gather(*(self._probe(ep) for ep in endpoints))
            await asyncio.sleep(self.cfg.interval)
