"""The gRPC server behind a TLS gate that says whom it turned away, and why.

With ``ssl=`` given to the event loop's server, a client whose certificate fails
(another CA, expired, none at all) is dropped inside the TLS layer without a word
to the application. Here each accepted connection does its own handshake with
``loop.start_tls``: a failure is reported through ``on_refused`` with the peer's
address and the verification error, and only a verified connection reaches
grpclib. Identity checks on the verified certificate (node id, router role) are
made by the stream handlers, which see it through ``stream.peer``.

Every handler's stream is bounded (:mod:`llmgw_proto.grpc_limits`): a message whose
length prefix announces more than ``max_message`` bytes ends the call with
``RESOURCE_EXHAUSTED`` before its body is read.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import Any

import grpclib.server
from grpclib.protocol import H2Protocol
from llmgw_proto.grpc_limits import DEFAULT_MAX_MESSAGE, TooLargeHook, bound_handlers
from llmgw_proto.tls_probe import looks_like_tls

__all__ = ["GatedServer", "RefusalHook"]

# (peer address, reason) for every connection the TLS handshake refused.
RefusalHook = Callable[[str, str], None]
HANDSHAKE_TIMEOUT = 10.0


class _Gate(asyncio.Protocol):
    """Holds a fresh connection until its TLS handshake is done, then hands it over."""

    def __init__(
        self, ctx: ssl.SSLContext, make_inner: Callable[[], H2Protocol], on_refused: RefusalHook
    ) -> None:
        self.ctx = ctx
        self.make_inner = make_inner
        self.on_refused = on_refused
        self.inner: H2Protocol | None = None
        self.early: list[bytes] = []
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.task = asyncio.get_running_loop().create_task(self._handshake(transport))

    async def _handshake(self, transport: asyncio.Transport) -> None:
        peer = transport.get_extra_info("peername")
        address = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        loop = asyncio.get_running_loop()
        try:
            tls = await loop.start_tls(
                transport,
                self,
                self.ctx,
                server_side=True,
                ssl_handshake_timeout=HANDSHAKE_TIMEOUT,
            )
        except (ssl.SSLError, OSError, TimeoutError) as err:
            reason = getattr(err, "reason", None) or str(err) or type(err).__name__
            verify = getattr(err, "verify_message", None)
            if reason in _NOT_TLS:
                # Plaintext (HTTP/2's preface) where a TLS ClientHello belongs.
                self.on_refused(address, PLAINTEXT_CLIENT)
            else:
                self.on_refused(address, f"{reason}: {verify}" if verify else str(reason))
            transport.abort()
            return
        if tls is None:  # the connection went away during the handshake
            return
        inner = self.make_inner()
        tls.set_protocol(inner)
        self.inner = inner
        inner.connection_made(tls)
        for chunk in self.early:
            inner.data_received(chunk)
        self.early.clear()

    def data_received(self, data: bytes) -> None:
        # Decrypted bytes that arrived between the handshake and the handover.
        if self.inner is not None:
            self.inner.data_received(data)
        else:
            self.early.append(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.inner is not None:
            self.inner.connection_lost(exc)
        elif self.task is not None and not self.task.done():
            self.task.cancel()

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()


# What OpenSSL says when a connection's first bytes are not a TLS record.
_NOT_TLS = frozenset({"WRONG_VERSION_NUMBER", "HTTP_REQUEST", "HTTPS_PROXY_REQUEST"})
PLAINTEXT_CLIENT = (
    "TLS mismatch: a plaintext client (an agent or router with tls.insecure or --insecure) "
    "reached this TLS listener: give it tls cert, key and ca, or run both in plaintext"
)
TLS_CLIENT = (
    "TLS mismatch: a TLS client (an agent or router with tls cert, key and ca) reached this "
    "plaintext listener (--insecure or tls.insecure): give the control plane tls cert, key "
    "and ca, or run both in plaintext"
)


class _Sniff(asyncio.Protocol):
    """A plaintext listener's connection: one that opens with a TLS record is refused
    with a sentence (the client sees only its handshake fail); any other goes on."""

    def __init__(self, inner: H2Protocol, on_refused: RefusalHook) -> None:
        self.inner = inner
        self.on_refused = on_refused
        self.transport: asyncio.Transport | None = None
        self.judged = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.judged:
            self.judged = True
            if looks_like_tls(data):
                peer = self.transport.get_extra_info("peername") if self.transport else None
                address = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
                self.on_refused(address, TLS_CLIENT)
                if self.transport is not None:
                    self.transport.abort()
                return
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class GatedServer(grpclib.server.Server):
    """A grpclib server whose TLS handshakes report refusals; plaintext without ``ssl``."""

    def __init__(
        self,
        handlers: Any,
        *,
        ssl_context: ssl.SSLContext | None,
        on_refused: RefusalHook,
        max_message: int = DEFAULT_MAX_MESSAGE,
        on_too_large: TooLargeHook | None = None,
    ) -> None:
        super().__init__(handlers)
        # Every service this server has (agents, endpoints, any other) gets the bound.
        self._mapping = bound_handlers(self._mapping, max_message, on_too_large)
        self._gate_ctx = ssl_context
        self._on_refused = on_refused

    def _protocol_factory(self) -> H2Protocol:
        inner = super()._protocol_factory
        if self._gate_ctx is None:
            return _Sniff(inner(), self._on_refused)  # type: ignore[return-value]
        gate = _Gate(self._gate_ctx, inner, self._on_refused)
        return gate  # type: ignore[return-value]  # it hands over to an H2Protocol

    async def start_gated(self, host: str, port: int) -> None:
        """Listen on host:port; TLS (if any) is done per connection by the gate."""
        await self.start(host, port, reuse_address=True)
