"""Dynamic endpoints and engine load from the control plane (`EndpointService`).

On one channel to the control plane's leader the router holds two streams:

- ``Watch``: snapshots of the ready endpoints (and the declared models). Each becomes a
  new :class:`EndpointSet` swapped in with one assignment.
- ``WatchLoad``: the engines' load figures (running, waiting, KV-cache use, generation),
  applied to the endpoints in place; a load change never touches the snapshot.

and calls ``ReportDemand`` while requests are held for a model scaled to zero.

When the channel breaks the router keeps serving the last snapshot, drops the engines'
figures (it balances on its own counts until they come back) and subscribes again after
a jittered backoff, so a fleet of routers does not return in step. With several control
plane addresses (`control.addresses`, or a DNS name with several records) it tries
them in turn; a standby answers UNAVAILABLE with the leader's address in the trailing
metadata key ``llmgw-leader`` and the router goes there next.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import math
import re
import socket
import ssl
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import structlog
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError
from llmgw_proto.addr import HostPort, format_hostport, parse_endpoint_url, parse_hostport
from llmgw_proto.backoff import Backoff
from llmgw_proto.grpc_limits import BoundedChannel, log_too_large
from llmgw_proto.keepalive import keepalive
from llmgw_proto.tls import CertReloader, client_context
from llmgw_proto.v1 import (
    DemandReply,
    DemandRequest,
    EndpointCache,
    EndpointSnapshot,
    EngineKind,
    LoadUpdate,
    WatchRequest,
)
from llmgw_proto.v1 import Endpoint as WireEndpoint
from llmgw_proto.v1 import EndpointLoad as WireLoad

from llmgw_router.balancing import CacheAware
from llmgw_router.config import ControlConfig
from llmgw_router.control.prefixes import PrefixSharer
from llmgw_router.control.requests import RequestsReporter
from llmgw_router.endpoints import CacheChange, Endpoint, EndpointSpec, EngineLoad
from llmgw_router.lora import apply_adapters
from llmgw_router.state import RouterState, now

if TYPE_CHECKING:
    from llmgw_router.control.keys import KeysClient

__all__ = ["EndpointWatcher", "LeaderRedirect", "control_ssl", "load_from_wire", "spec_from_wire"]

log = structlog.get_logger(__name__)

# The largest message read from the control plane (an endpoint snapshot, a load update).
MAX_RECEIVED = 64 * 1024 * 1024


_too_large = log_too_large(log, "message from the control plane refused: too large")


LEADER_KEY = "llmgw-leader"
_WATCH = "/llmgw.v1.EndpointService/Watch"
_WATCH_LOAD = "/llmgw.v1.EndpointService/WatchLoad"
_REPORT_DEMAND = "/llmgw.v1.EndpointService/ReportDemand"

M = TypeVar("M")


class LeaderRedirect(Exception):
    """A standby said who leads: go there."""

    def __init__(self, leader: HostPort, detail: str) -> None:
        super().__init__(f"standby; leader is {leader}: {detail}")
        self.leader = leader


# What may go into an Authorization header: visible ASCII (no CR/LF to split the head).
_HEADER_VALUE = re.compile(r"[\x21-\x7e]*")


def spec_from_wire(ep: WireEndpoint) -> EndpointSpec:
    models = tuple(ep.served_model_names) or ((ep.model,) if ep.model else ())
    return EndpointSpec(
        id=ep.id,
        url=ep.url.rstrip("/"),
        models=models,
        profile=ep.profile,
        weight=max(1, ep.weight),
        health_path=ep.health_path or "/health",
        node_id=ep.node_id,
        replica_id=ep.replica_id,
        labels=tuple(sorted(ep.labels.items())),
        generation=ep.generation,
        api_key=ep.api_key if _HEADER_VALUE.fullmatch(ep.api_key) else "",
        routes=frozenset(ep.routes),
        role=ep.role if ep.role in ("prefill", "decode") else "",
        engine=_ENGINE_NAMES.get(ep.engine, ""),
        kv_port=ep.kv_port,
        leaving=ep.leaving,
        slot=ep.slot,
    )


_ENGINE_NAMES = {
    EngineKind.VLLM: "vllm",
    EngineKind.SGLANG: "sglang",
    EngineKind.LLAMACPP: "llamacpp",
}


@functools.lru_cache(maxsize=16384)
def url_problem(url: str) -> str:
    """Why a router cannot dial ``url`` ("" when it can): the control plane's own rule."""
    try:
        parse_endpoint_url(url)
    except ValueError as err:
        return str(err)
    return ""


def load_from_wire(load: WireLoad, received_at: float) -> EngineLoad | None:
    """The figures of one EndpointLoad; None when the control plane says unknown."""
    if not load.known:
        return None
    age = load.age.total_seconds() if load.age is not None else 0.0
    return EngineLoad(
        running=load.running,
        waiting=load.waiting,
        kv_cache_usage=float(load.kv_cache_usage),
        prefix_cache_queries=load.prefix_cache_queries,
        prefix_cache_hits=load.prefix_cache_hits,
        generation=load.generation,
        measured_at=received_at - max(0.0, age),
        cache_tokens=load.cache_tokens,
        prefill_tokens_per_second=(
            rate
            if math.isfinite(rate := float(load.prefill_tokens_per_second)) and rate > 0
            else 0.0
        ),
    )


def control_ssl(control: ControlConfig, insecure: bool) -> ssl.SSLContext | None:
    """The mTLS client context for the control plane; None for plaintext.

    Raises ValueError naming the config field when a file cannot be used.
    """
    tls = control.tls.with_insecure_flag(insecure)
    if tls.insecure:
        return None
    if not (tls.cert and tls.key and tls.ca):
        raise ValueError("control.tls: cert, key and ca are required unless insecure")
    try:
        return client_context(*tls.files())
    except (OSError, ssl.SSLError) as err:
        raise ValueError(f"control.tls: cannot load cert/key/ca: {err}") from None


def _leader_from(metadata: Any) -> HostPort | None:
    if not metadata:
        return None
    value = metadata.get(LEADER_KEY)
    if not value:
        return None
    with contextlib.suppress(ValueError):
        return parse_hostport(str(value))
    return None


async def _server_stream(
    channel: Channel,
    route: str,
    request: Any,
    reply: type[M],
    on_open: Callable[[], None] | None = None,
) -> AsyncIterator[M]:
    """A server-streaming call that turns a standby's answer into :class:`LeaderRedirect`."""
    async with channel.request(route, Cardinality.UNARY_STREAM, type(request), reply) as stream:
        try:
            await stream.send_message(request, end=True)
            await stream.recv_initial_metadata()
            if on_open is not None:
                on_open()
            async for message in stream:
                yield message
        except GRPCError as err:
            leader = _leader_from(stream.trailing_metadata) or _leader_from(stream.initial_metadata)
            if err.status is Status.UNAVAILABLE and leader is not None:
                raise LeaderRedirect(leader, err.message or "") from None
            raise


class EndpointWatcher:
    def __init__(
        self,
        state: RouterState,
        control: ControlConfig,
        *,
        insecure: bool,
        router_id: str,
        static: tuple[EndpointSpec, ...] = (),
    ) -> None:
        self.state = state
        self.control = control
        self.router_id = router_id
        self.static = static
        # Endpoint URLs ignored as unparseable, each logged once (bounded).
        self.refused_urls: set[str] = set()
        self.ssl = control_ssl(control, insecure)
        tls = control.tls
        # Rotated certificate files are read again before each new subscription.
        self.reloader = (
            CertReloader(self.ssl, *tls.files())
            if self.ssl is not None and tls.cert and tls.key and tls.ca
            else None
        )
        self.targets = control.targets()
        self.backoff = Backoff(control.backoff_base, control.backoff_cap)
        self.load_backoff = Backoff(control.backoff_base, control.backoff_cap)
        self.subscribed = False
        self.leader: HostPort | None = None
        self._next = 0
        self._demand = asyncio.Event()
        state.on_demand.append(lambda model: self._demand.set())
        state.lora.wake = self._demand.set
        # Keys and shares (control/keys.py), on the same channel; None: not asked for.
        self.keys: KeysClient | None = None
        # Per-model request figures for the control plane's status page (requests.py).
        self.requests = RequestsReporter(state.metrics, router_id)
        # The prefixes shared with the fleet's routers (prefixes.py), where cache_aware
        # places homes by the shared rule (and cache_aware.share_prefixes); None where not.
        balancer = state.balancer
        self.prefixes = (
            PrefixSharer(balancer, router_id)
            if isinstance(balancer, CacheAware)
            and balancer.shared_homes
            and state.config.cache_aware.share_prefixes
            else None
        )

    # ------------------------------------------------------------------ snapshots

    def apply(self, snapshot: EndpointSnapshot, first_on_stream: bool) -> bool:
        current = self.state.endpoints
        # Within one stream versions only grow; a new stream may come from a restarted
        # control plane that counts from 1 again, so its first snapshot always wins.
        if (
            not first_on_stream
            and current.source == "control"
            and snapshot.version < current.version
        ):
            log.warning("older snapshot ignored", version=snapshot.version, have=current.version)
            return False
        specs = [spec_from_wire(ep) for ep in snapshot.endpoints if ep.url and self._dialable(ep)]
        declared: dict[str, bool] = {}
        for model in snapshot.models:
            for name in model.served_model_names or [model.name]:
                declared[name] = declared.get(name, False) or model.scale_to_zero
        # LoRA adapters: name -> the base model's (first) served name.
        adapters = {
            adapter: (model.served_model_names or [model.name])[0]
            for model in snapshot.models
            for adapter in model.adapters
        }
        # Read before successor(): it updates a kept endpoint's spec in place.
        before = {ep.id: ep.generation for ep in current.endpoints}
        new = current.successor(
            [*self.static, *specs],
            version=snapshot.version,
            source="control",
            declared=declared,
            adapters=adapters,
        )
        kept = {ep.id: ep.generation for ep in new.endpoints}
        for ident, generation in before.items():
            if kept.get(ident, -1) != generation:
                # Gone, or another engine process behind it: its cache is not ours to know.
                self.state.balancer.forget(ident)
        self.state.swap(new)
        log.info("endpoint snapshot applied", version=snapshot.version, endpoints=len(specs))
        return True

    def _dialable(self, ep: WireEndpoint) -> bool:
        """False for an endpoint whose URL cannot be parsed: it is ignored, logged once.

        A control plane of this version never publishes one (it fails the shard); an
        older one might, and dialling it could only fail (issue 24.7).
        """
        problem = url_problem(ep.url)
        if not problem:
            return True
        if ep.url not in self.refused_urls and len(self.refused_urls) < 1024:
            self.refused_urls.add(ep.url)
            log.warning(
                "endpoint ignored: its URL cannot be dialled", endpoint=ep.id, error=problem
            )
        return False

    # ------------------------------------------------------------------ addresses

    async def _addresses(self) -> list[tuple[str, int, str | None]]:
        """(connect host, port, TLS name) to try, the known leader first.

        A name with several DNS records stands for several instances: each address is
        tried, with the name kept for the certificate check.
        """
        out: list[tuple[str, int, str | None]] = []
        targets = ([self.leader] if self.leader is not None else []) + self.targets
        loop = asyncio.get_running_loop()
        for target in targets:
            host = target.host
            try:
                ipaddress.ip_address(host)
                out.append((host, target.port, None))
                continue
            except ValueError:
                pass
            try:
                infos = await loop.getaddrinfo(host, target.port, type=socket.SOCK_STREAM)
            except OSError:
                out.append((host, target.port, None))
                continue
            addrs = list(dict.fromkeys(str(info[4][0]) for info in infos))
            if len(addrs) <= 1:
                out.append((host, target.port, None))
            else:
                out += [(addr, target.port, host) for addr in addrs]
        return list(dict.fromkeys(out))

    # ------------------------------------------------------------------ one session

    def _channel(self, host: str, port: int, name: str | None) -> Channel:
        # Pings find a control plane that froze or vanished without closing the
        # connection: one unanswered for keepalive_timeout ends both streams.
        config = keepalive(
            self.control.keepalive,
            self.control.keepalive_timeout,
            ssl_target_name_override=name if self.ssl is not None else None,
        )
        # Snapshots may be large (about 250 bytes an endpoint): 64 MiB, not gRPC's 4 MiB.
        return BoundedChannel(
            host, port, ssl=self.ssl, config=config, max_message=MAX_RECEIVED, on_refused=_too_large
        )

    async def _subscribe_once(self, host: str, port: int, name: str | None) -> None:
        """One session on one channel: Watch, with WatchLoad and demand reports beside it.

        It ends when Watch ends, or when the load stream finds the connection gone (a
        reconnect by one stream would leave the other waiting on the old connection).
        """
        if self.reloader is not None:
            self.reloader.check()
        channel = self._channel(host, port, name)
        address = format_hostport(name or host, port)
        lost = asyncio.Event()
        helpers: list[asyncio.Task[None]] = []
        watch = asyncio.create_task(self._watch(channel, address, helpers, lost))
        lost_wait = asyncio.create_task(lost.wait())
        try:
            await asyncio.wait({watch, lost_wait}, return_when=asyncio.FIRST_COMPLETED)
            if watch.done():
                watch.result()
            else:
                raise ConnectionError("connection lost (seen on the load stream)")
        finally:
            self.subscribed = False
            self.state.control.connected = False
            for task in (watch, lost_wait, *helpers):
                task.cancel()
            await asyncio.gather(watch, lost_wait, *helpers, return_exceptions=True)
            self.state.forget_loads()
            channel.close()

    async def _watch(
        self, channel: Channel, address: str, helpers: list[asyncio.Task[None]], lost: asyncio.Event
    ) -> None:
        request = WatchRequest(router_id=self.router_id, known_version=self.state.endpoints.version)
        first = True

        def opened() -> None:
            self.state.control.connected = True
            self.state.control.address = address
            self.state.control.reason = ""

        async for snapshot in _server_stream(channel, _WATCH, request, EndpointSnapshot, opened):
            if first:
                self.subscribed = True
                self.state.control.connected = True
                self.state.control.address = address
                self.backoff.reset()
                if self.state.config.load_reports.enabled:
                    helpers.append(asyncio.create_task(self._load_loop(channel, lost)))
                helpers.append(asyncio.create_task(self._demand_loop(channel)))
                helpers.append(asyncio.create_task(self.requests.report(channel)))
                if self.prefixes is not None:
                    helpers.append(asyncio.create_task(self.prefixes.share(channel)))
                if self.keys is not None:
                    helpers.append(asyncio.create_task(self.keys.watch(channel)))
                    helpers.append(asyncio.create_task(self.keys.report(channel)))
            self.apply(snapshot, first)
            first = False

    async def _load_loop(self, channel: Channel, lost: asyncio.Event) -> None:
        """``WatchLoad`` on the session's channel, resubscribed with its own backoff.

        A refusal by the control plane (a gRPC status: an older control plane without
        WatchLoad, say) is retried on the same channel; a lost connection ends the session.
        """
        while True:
            try:
                request = WatchRequest(router_id=self.router_id)
                async for update in _server_stream(channel, _WATCH_LOAD, request, LoadUpdate):
                    self.load_backoff.reset()
                    self.apply_load(update)
                reason = "stream ended"
            except GRPCError as err:
                if err.status is Status.UNIMPLEMENTED:
                    reason = "the control plane does not serve WatchLoad"
                else:
                    reason = f"{type(err).__name__}: {err}"
            except Exception:
                self.state.forget_loads()
                lost.set()
                return
            self.state.forget_loads()
            delay = self.load_backoff.next()
            log.warning(
                "load stream lost; balancing on this router's own counts",
                reason=reason,
                retry_in=round(delay, 3),
            )
            await asyncio.sleep(delay)

    def apply_load(self, update: LoadUpdate) -> None:
        received = now()
        self.state.metrics.load_updates.inc()
        self.state.apply_loads(
            ((load.endpoint_id, load_from_wire(load, received)) for load in update.loads),
            update.full,
        )
        by_id = self.state.endpoints.by_id
        if apply_adapters(by_id, ((w.endpoint_id, w.adapters) for w in update.loads), update.full):
            for callback in self.state.on_endpoints:
                callback()  # held adapter requests look for a holder again
        if update.caches:
            self.state.apply_caches(
                (cache.endpoint_id, cache_from_wire(cache)) for cache in update.caches
            )

    async def _demand_loop(self, channel: Channel) -> None:
        """While requests are held, say so: at once, then every `hold.demand_interval`."""
        interval = self.state.config.hold.demand_interval
        while True:
            if not self.state.held and not self.state.lora.requests:
                self._demand.clear()
                await self._demand.wait()
            # Adapters' requests since the last report go with their held counts.
            requests = self.state.lora.take()
            wanted = {**dict.fromkeys(requests, 0), **self.state.held}
            for model, held in wanted.items():
                try:
                    async with channel.request(
                        _REPORT_DEMAND,
                        Cardinality.UNARY_UNARY,
                        DemandRequest,
                        DemandReply,
                        timeout=5.0,
                    ) as stream:
                        await stream.send_message(
                            DemandRequest(
                                router_id=self.router_id,
                                model=model,
                                held=held,
                                requests=requests.get(model, 0),
                            ),
                            end=True,
                        )
                        reply = await stream.recv_message()
                    if reply is not None and not reply.accepted:
                        log.warning("demand not accepted", model=model, reason=reply.reason)
                    else:
                        log.info("demand reported", model=model, held=held)
                except Exception as err:
                    log.warning("demand report failed", model=model, error=str(err))
            self._demand.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._demand.wait()

    # ------------------------------------------------------------------ forever

    async def run(self) -> None:
        log.info(
            "watching control plane", address=self.control.describe(), tls=self.ssl is not None
        )
        while True:
            addresses = await self._addresses()
            host, port, name = addresses[self._next % len(addresses)]
            shown = format_hostport(name or host, port)
            redirected = False
            try:
                await self._subscribe_once(host, port, name)
                reason = "stream ended"
            except LeaderRedirect as redirect:
                reason = str(redirect)
                redirected = self.leader != redirect.leader
                self.leader = redirect.leader
                self._next = 0
            except Exception as err:
                # Whatever broke the stream (gRPC status, reset, TLS, protocol errors),
                # the watcher itself must live on.
                reason = f"{type(err).__name__}: {err}"
                if (host, port) == ((self.leader.host, self.leader.port) if self.leader else None):
                    # The leader we were sent to is gone: back to the configured list.
                    self.leader = None
                self._next += 1
            self.state.control.reason = reason
            self.state.control.address = shown
            if redirected:
                log.info("following the control plane's leader", leader=str(self.leader))
                continue
            delay = self.backoff.next()
            log.warning(
                "control plane stream lost; serving the last snapshot",
                address=shown,
                reason=reason,
                retry_in=round(delay, 3),
                version=self.state.endpoints.version,
            )
            await asyncio.sleep(delay)


def cache_from_wire(cache: EndpointCache) -> CacheChange:
    """One engine's cache change, from the wire."""
    return CacheChange(
        cleared=cache.cleared,
        generation=cache.generation,
        stored=cache.stored,
        removed=cache.removed,
        by_token_ids=cache.token_hashes,
        block_size=cache.block_size,
    )


def apply_cache(ep: Endpoint, cache: EndpointCache) -> None:
    """One engine's cache change from the wire, told to the endpoint that keeps it."""
    ep.cache_changed(cache_from_wire(cache))
