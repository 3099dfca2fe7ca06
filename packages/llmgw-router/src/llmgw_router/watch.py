"""Dynamic endpoints: the control plane's `EndpointService.Watch` stream.

Each snapshot becomes a new :class:`EndpointSet` swapped in with one assignment.
When the stream breaks the router keeps serving the last snapshot and subscribes
again after a jittered backoff, so a fleet of routers does not return in step.
"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import structlog
from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.exceptions import GRPCError, StreamTerminatedError
from llmgw_proto.backoff import Backoff
from llmgw_proto.tls import CertReloader, client_context
from llmgw_proto.v1 import Endpoint as WireEndpoint
from llmgw_proto.v1 import EndpointServiceStub, EndpointSnapshot, WatchRequest

from llmgw_router.config import ControlConfig
from llmgw_router.endpoints import EndpointSpec
from llmgw_router.proxy import RouterState

__all__ = ["EndpointWatcher", "control_ssl", "spec_from_wire"]

log = structlog.get_logger(__name__)


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
    )


def control_ssl(control: ControlConfig, insecure: bool) -> ssl.SSLContext | None:
    """The mTLS client context for the control plane; None for plaintext.

    Raises ValueError naming the config field when a file cannot be used.
    """
    tls = control.tls
    if insecure or tls.insecure:
        return None
    if not (tls.cert and tls.key and tls.ca):
        raise ValueError("control.tls: cert, key and ca are required unless insecure")
    try:
        return client_context(Path(tls.cert), Path(tls.key), Path(tls.ca))
    except (OSError, ssl.SSLError) as err:
        raise ValueError(f"control.tls: cannot load cert/key/ca: {err}") from None


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
        self.ssl = control_ssl(control, insecure)
        # Rotated certificate files are read again before each new subscription.
        self.reloader = (
            CertReloader(
                self.ssl, Path(control.tls.cert), Path(control.tls.key), Path(control.tls.ca)
            )
            if self.ssl is not None and control.tls.cert and control.tls.key and control.tls.ca
            else None
        )
        host, _, port = control.address.rpartition(":")
        self.host = host
        self.port = int(port)
        self.backoff = Backoff(control.backoff_base, control.backoff_cap)
        self.subscribed = False

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
        specs = [spec_from_wire(ep) for ep in snapshot.endpoints if ep.url]
        new = current.successor([*self.static, *specs], version=snapshot.version, source="control")
        self.state.swap(new)
        log.info("endpoint snapshot applied", version=snapshot.version, endpoints=len(specs))
        return True

    async def _subscribe_once(self) -> None:
        if self.reloader is not None:
            self.reloader.check()
        channel = Channel(
            self.host,
            self.port,
            ssl=self.ssl,
            # Pings find a control plane that vanished without closing the connection.
            config=Configuration(_keepalive_time=10.0, _keepalive_timeout=10.0),
        )
        try:
            stub = EndpointServiceStub(channel)
            request = WatchRequest(
                router_id=self.router_id, known_version=self.state.endpoints.version
            )
            first = True
            async for snapshot in stub.watch(request):
                self.subscribed = True
                self.backoff.reset()
                self.apply(snapshot, first)
                first = False
        finally:
            self.subscribed = False
            channel.close()

    async def run(self) -> None:
        log.info("watching control plane", address=self.control.address, tls=self.ssl is not None)
        while True:
            try:
                await self._subscribe_once()
                reason = "stream ended"
            except (TimeoutError, GRPCError, StreamTerminatedError, OSError) as err:
                reason = f"{type(err).__name__}: {err}"
            delay = self.backoff.next()
            log.warning(
                "control plane stream lost; serving the last snapshot",
                reason=reason,
                retry_in=round(delay, 3),
                version=self.state.endpoints.version,
            )
            await asyncio.sleep(delay)
