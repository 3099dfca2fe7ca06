"""EndpointService.Watch: the ready replicas' leader endpoints, as versioned snapshots.

A subscriber gets the whole snapshot at once, then again after every change; a
subscriber that falls behind gets only the newest (snapshots replace each other).
Versions only grow while one control plane runs, and start from the wall clock in
milliseconds, so a restarted control plane (or a new leader whose clock agrees)
begins above what a router already holds. Nothing here relies on that across
control planes: a router takes the first snapshot of every new stream whatever its
version, and within one stream ignores an older one. Load figures travel on their
own stream (:mod:`llmgw_control.loads`) and never bump the version.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import grpclib.const
import grpclib.server
import structlog
from grpclib.exceptions import GRPCError
from llmgw_proto import v1
from llmgw_proto.tls import UnreadableIdentity, read_identity

from llmgw_control.loads import LoadBook
from llmgw_control.metrics import Metrics
from llmgw_control.wire import recv

__all__ = [
    "DeclaredInfo",
    "EndpointInfo",
    "Publisher",
    "address_problem",
    "engine_generation",
]

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
    # Changes whenever the engine process behind the endpoint changes.
    generation: int = 0
    engine: str = ""
    # The leader shard behind it: where its load figures come from.
    shard_id: str = ""
    # The secret the engine's port requires: sent to routers only, never shown.
    api_key: str = ""
    # The HTTP paths the engine serves (the agent read them at READY); (): not known.
    routes: tuple[str, ...] = ()
    # A disaggregated pool's role ("prefill"/"decode", "" aggregated) and KV port (issue 32).
    role: str = ""
    kv_port: int = 0
    # About to be taken away (issue 28, leaving.py): routers warm its heirs.
    leaving: bool = False
    # Its place within its model/profile (slots.py): routers rank by it, so a
    # replacement inherits its predecessor's prefixes; "" not known.
    slot: str = ""

    def __repr__(self) -> str:
        shown = self._replace(api_key="***") if self.api_key else self
        return "EndpointInfo" + repr(tuple(shown))

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
            generation=self.generation,
            engine=_ENGINES.get(self.engine, v1.EngineKind.UNSPECIFIED),
            api_key=self.api_key,
            routes=list(self.routes),
            role=self.role,
            kv_port=self.kv_port,
            leaving=self.leaving,
            slot=self.slot,
        )


_ENGINES = {
    "vllm": v1.EngineKind.VLLM,
    "sglang": v1.EngineKind.SGLANG,
    "llamacpp": v1.EngineKind.LLAMACPP,
}


def engine_generation(shard_id: str, pid: int) -> int:
    """A number that changes when the engine process changes, the same after a restart.

    A retried shard gets a new id and a restarted engine a new pid; derived from both,
    the generation a restarted control plane computes for an adopted engine is the one
    routers already hold, so they keep what they learned of its cache.
    """
    digest = hashlib.blake2b(f"{shard_id}/{pid}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return None


def address_problem(
    url: str, peer_host: str, interfaces: Mapping[str, Sequence[str]]
) -> str | None:
    """Why routers may not reach an engine at ``url``, its agent's endpoint URL; None if fine.

    Pure. The control plane publishes the agent's URL as it is; this only says, loudly,
    when it cannot be right: a loopback URL from a node whose stream comes from
    elsewhere (only that node can dial it), or an address that is neither one of the
    node's interfaces nor the address its stream comes from (nothing listens there).
    A host name cannot be checked and passes.
    """
    if not url:
        return "its agent reported no endpoint URL: nothing is published for it"
    host = urllib.parse.urlsplit(url).hostname or ""
    ip = _ip(host)
    if ip is None:
        return None
    peer = _ip(peer_host)
    if ip.is_loopback:
        if peer is not None and not peer.is_loopback:
            return (
                f"endpoint {url} is a loopback address, but the node's stream comes from "
                f"{peer_host}: routers on other hosts cannot reach it (set the agent's "
                "advertise_host, and engine_host to an address routers can dial)"
            )
        return None
    own = {_ip(a.split("/")[0]) for addresses in interfaces.values() for a in addresses}
    if ip in own or (peer is not None and ip == peer):
        return None
    if not own and peer is None:
        return None  # nothing known to compare with
    where = ", ".join(sorted({a.split("/")[0] for v in interfaces.values() for a in v})) or "none"
    return (
        f"endpoint {url}: {host} is not an address of the node (interfaces: {where}; "
        f"stream from {peer_host or 'unknown'}), so nothing may listen there (check the "
        "agent's advertise_host and engine_host)"
    )


class DeclaredInfo(NamedTuple):
    """A model the catalog declares, published with or without ready replicas."""

    name: str
    served_model_names: tuple[str, ...]
    scale_to_zero: bool
    # Its LoRA adapters' names (issue 30).
    adapters: tuple[str, ...] = ()

    def message(self) -> v1.DeclaredModel:
        return v1.DeclaredModel(
            name=self.name,
            served_model_names=list(self.served_model_names),
            scale_to_zero=self.scale_to_zero,
            adapters=list(self.adapters),
        )


# WatchLoad: at most this many updates a second per router, and every endpoint's
# figures again at least this often (their age tells the router how fresh they are).
LOAD_UPDATES_PER_SECOND = 10
LOAD_REFRESH = 1.0

DemandHook = Callable[[v1.DemandRequest], v1.DemandReply]


class Publisher:
    def __init__(self, metrics: Metrics | None = None) -> None:
        self.version = int(time.time() * 1000)
        self.endpoints: tuple[EndpointInfo, ...] = ()
        self.models: tuple[DeclaredInfo, ...] = ()
        # The engines' load figures, streamed on WatchLoad apart from the snapshots.
        self.loads = LoadBook()
        # Set by the controller: what ReportDemand does with a router's demand.
        self.on_demand: DemandHook | None = None
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
        addr = stream.peer.addr() if stream.peer is not None else None
        try:
            identity = read_identity(cert)
        except UnreadableIdentity as err:
            why = f"unreadable certificate identity: {err}"
            log.warning(
                "watch refused", peer=str(addr[0]) if addr else "", router_id=router_id, why=why
            )
            if self._metrics is not None:
                self._metrics.refusals.labels("watch", "identity").inc()
            raise GRPCError(grpclib.const.Status.PERMISSION_DENIED, why) from None
        if identity.role == "router":
            return
        name, role = identity.name, identity.role
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
            f"only a router certificate may watch endpoints; this one is for {role} {name!r}",
        )

    def snapshot(self) -> v1.EndpointSnapshot:
        if self._snapshot is None or self._snapshot.version != self.version:
            self._snapshot = v1.EndpointSnapshot(
                version=self.version,
                endpoints=[e.message() for e in self.endpoints],
                models=[m.message() for m in self.models],
            )
        return self._snapshot

    def update(
        self, endpoints: Sequence[EndpointInfo], models: Sequence[DeclaredInfo] | None = None
    ) -> bool:
        """Publish ``endpoints`` (and ``models``) if they differ from what is; True if so."""
        # Plain tuples compare fast; proto messages are built only for a new version.
        ordered = tuple(sorted(endpoints))
        declared = self.models if models is None else tuple(sorted(models))
        self.loads.set_endpoints(
            {e.id: (e.shard_id, e.generation) for e in ordered}, time.monotonic()
        )
        if ordered == self.endpoints and declared == self.models:
            return False
        self.endpoints = ordered
        self.models = declared
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
            ),
            "/llmgw.v1.EndpointService/WatchLoad": grpclib.const.Handler(
                self.watch_load,
                grpclib.const.Cardinality.UNARY_STREAM,
                v1.WatchRequest,
                v1.LoadUpdate,
            ),
            "/llmgw.v1.EndpointService/ReportDemand": grpclib.const.Handler(
                self.report_demand,
                grpclib.const.Cardinality.UNARY_UNARY,
                v1.DemandRequest,
                v1.DemandReply,
            ),
        }

    async def watch_load(
        self, stream: grpclib.server.Stream[v1.WatchRequest, v1.LoadUpdate]
    ) -> None:
        """A full picture of every endpoint's load, then coalesced changes."""
        request = await recv(stream, "load watch stream") or v1.WatchRequest()
        self._check_router(stream, request.router_id)
        sub = self.loads.subscribe(request.router_id)
        log.info("router watches load", router_id=request.router_id)
        try:
            await stream.send_message(self.loads.full(sub, time.monotonic()))
            gap = 1.0 / LOAD_UPDATES_PER_SECOND
            while True:
                refresh = False
                try:
                    await asyncio.wait_for(sub.changed.wait(), LOAD_REFRESH)
                except TimeoutError:
                    refresh = True
                update = self.loads.take(sub, time.monotonic(), refresh=refresh)
                if update is not None:
                    await stream.send_message(update)
                # Coalesce: what changes meanwhile goes out together in the next update.
                await asyncio.sleep(gap)
        finally:
            self.loads.unsubscribe(sub)

    async def report_demand(
        self, stream: grpclib.server.Stream[v1.DemandRequest, v1.DemandReply]
    ) -> None:
        request = await recv(stream, "demand call") or v1.DemandRequest()
        self._check_router(stream, request.router_id)
        if self.on_demand is None:
            reply = v1.DemandReply(accepted=False, reason="this control plane takes no demand")
        else:
            reply = self.on_demand(request)
        await stream.send_message(reply)

    async def watch(
        self, stream: grpclib.server.Stream[v1.WatchRequest, v1.EndpointSnapshot]
    ) -> None:
        request = await recv(stream, "watch stream") or v1.WatchRequest()
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
