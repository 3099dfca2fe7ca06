"""EndpointService.Watch: the ready replicas' leader endpoints, as versioned snapshots.

A subscriber gets the whole snapshot at once, then again after every change; a
subscriber that falls behind gets only the newest (snapshots replace each other).
Versions start from the wall clock in milliseconds so a restarted control plane
never goes back below what a router already holds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import grpclib.const
import grpclib.server
import structlog
from grpclib.exceptions import GRPCError
from llmgw_proto import v1
from llmgw_proto.tls import peer_identity

from llmgw_control.metrics import Metrics

__all__ = ["EndpointInfo", "Publisher"]

log = structlog.get_logger(__name__)


class EndpointInfo(NamedTuple):
    """One published endpoint; ordered by id, compared as a plain tuple."""

    id: str
    url: str
    served_model_names: tuple[str, ...]
    model: str
    profile: str
    weight: int
    node_id: str
    labels: tuple[tuple[str, str], ...]
    replica_id: str
    health_path: str

    def message(self) -> v1.Endpoint:
        return v1.Endpoint(
            id=self.id,
            url=self.url,
            served_model_names=list(self.served_model_names),
            model=self.model,
            profile=self.profile,
            weight=self.weight,
            node_id=self.node_id,
            labels=dict(self.labels),
            replica_id=self.replica_id,
            health_path=self.health_path,
        )


class Publisher:
    def __init__(self, metrics: Metrics | None = None) -> None:
        self.version = int(time.time() * 1000)
        self.endpoints: tuple[EndpointInfo, ...] = ()
        self._snapshot: v1.EndpointSnapshot | None = None
        self._subscribers: set[asyncio.Event] = set()
        self._metrics = metrics
        # Set once the control plane knows what runs (its startup grace is over). Until
        # then a restarted control plane would publish a partial set and routers would
        # drop endpoints that serve fine, so watchers wait, keeping what they have.
        self.primed = asyncio.Event()
        if metrics is not None:
            metrics.publish_version.set(self.version)

    def _check_router(self, stream: grpclib.server.Stream[Any, Any], router_id: str) -> None:
        """Over TLS only a router's certificate may watch: endpoints are the data path."""
        cert = stream.peer.cert() if stream.peer is not None else None
        if cert is None:
            return  # plaintext (--insecure): nobody is authenticated
        identity = peer_identity(cert)
        if identity is not None and identity.role == "router":
            return
        addr = stream.peer.addr() if stream.peer is not None else None
        name = identity.name if identity else ""
        role = identity.role if identity else ""
        log.warning(
            "watch refused",
            peer=str(addr[0]) if addr else "",
            name=name,
            role=role,
            router_id=router_id,
        )
        if self._metrics is not None:
            self._metrics.refusals.labels("watch", "not a router").inc()
        raise GRPCError(
            grpclib.const.Status.PERMISSION_DENIED,
            f"only a router certificate may watch endpoints; this one is for {role or 'peer'} {name!r}",
        )

    def snapshot(self) -> v1.EndpointSnapshot:
        if self._snapshot is None or self._snapshot.version != self.version:
            self._snapshot = v1.EndpointSnapshot(
                version=self.version, endpoints=[e.message() for e in self.endpoints]
            )
        return self._snapshot

    def update(self, endpoints: Sequence[EndpointInfo]) -> bool:
        """Publish ``endpoints`` if they differ from the current set; True if they did."""
        # Plain tuples compare fast; proto messages are built only for a new version.
        ordered = tuple(sorted(endpoints))
        if ordered == self.endpoints:
            return False
        self.endpoints = ordered
        self.version = max(self.version + 1, int(time.time() * 1000))
        for event in self._subscribers:
            event.set()
        if self._metrics is not None:
            self._metrics.publish_version.set(self.version)
            self._metrics.published.set(len(ordered))
        log.info("endpoints published", version=self.version, endpoints=len(ordered))
        return True

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            "/llmgw.v1.EndpointService/Watch": grpclib.const.Handler(
                self.watch,
                grpclib.const.Cardinality.UNARY_STREAM,
                v1.WatchRequest,
                v1.EndpointSnapshot,
            )
        }

    async def watch(
        self, stream: grpclib.server.Stream[v1.WatchRequest, v1.EndpointSnapshot]
    ) -> None:
        request = await stream.recv_message() or v1.WatchRequest()
        router_id = request.router_id
        self._check_router(stream, router_id)
        await self.primed.wait()
        changed = asyncio.Event()
        self._subscribers.add(changed)
        if self._metrics is not None:
            self._metrics.watchers.inc()
        log.info(
            "router subscribed",
            router_id=router_id,
            known_version=request.known_version,
        )
        try:
            sent = -1
            while True:
                changed.clear()
                if self.version != sent:
                    sent = self.version
                    await stream.send_message(self.snapshot())
                await changed.wait()
        finally:
            self._subscribers.discard(changed)
            if self._metrics is not None:
                self._metrics.watchers.dec()
            log.info("router unsubscribed", router_id=router_id)
