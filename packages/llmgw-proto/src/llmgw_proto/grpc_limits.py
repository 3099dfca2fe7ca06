"""A bound on the size of every gRPC message received, checked on its length prefix.

grpclib reads a message as a 5-byte prefix (a compressed flag and a big-endian
length) and then as many bytes as the prefix announces, whatever that is, before
anything can look at it. Here the protocol stream's ``recv_data`` is wrapped so that
the length is checked as soon as the prefix is read: a message announced larger than
the bound ends the call with ``RESOURCE_EXHAUSTED`` before its body is read (HTTP/2
flow control then stops the sender after one window; the body is never acknowledged
nor buffered beyond it). gRPC's usual default bound is 4 MiB.

Servers: :func:`bound_handlers` wraps every handler of a grpclib server mapping.
Clients: :func:`bound_channel_stream` bounds a client stream once its request is sent
(:class:`BoundedChannel` does that for every stream of a channel).
"""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable
from typing import Any

import grpclib.client
import grpclib.const
from grpclib.exceptions import GRPCError

from llmgw_proto.tls import UnreadableIdentity, read_identity

__all__ = [
    "DEFAULT_MAX_MESSAGE",
    "PREFIX",
    "BoundedChannel",
    "MessageTooLarge",
    "TooLargeHook",
    "announced_length",
    "bound_channel_stream",
    "bound_handlers",
    "bound_stream",
    "log_too_large",
    "too_large",
]

DEFAULT_MAX_MESSAGE = 4 * 1024 * 1024
PREFIX = 5  # gRPC's length-prefixed message: 1 byte compressed flag, 4 bytes length

# (method, peer "host:port", who (the certificate's role and name), announced length,
# limit) for every message refused.
TooLargeHook = Callable[[str, str, str, int, int], None]


def log_too_large(log: Any, event: str) -> TooLargeHook:
    """A hook that logs each refused message as ``event`` (a warning) on ``log``."""

    def hook(method: str, peer: str, who: str, length: int, limit: int) -> None:
        log.warning(event, method=method, peer=peer, identity=who, bytes=length, limit=limit)

    return hook


class MessageTooLarge(GRPCError):
    """A message announced larger than the bound: ``RESOURCE_EXHAUSTED``."""


def announced_length(prefix: bytes) -> int:
    """Pure: the message length a gRPC 5-byte prefix announces; ValueError if not a prefix."""
    if len(prefix) != PREFIX:
        raise ValueError(f"a gRPC message prefix is {PREFIX} bytes, not {len(prefix)}")
    return int(struct.unpack(">I", prefix[1:])[0])


def too_large(prefix: bytes, limit: int) -> int | None:
    """Pure: the announced length when it exceeds ``limit``, else None."""
    length = announced_length(prefix)
    return length if length > limit else None


def _describe(length: int, limit: int) -> str:
    return (
        f"message of {length} bytes is larger than the limit of {limit} bytes (max_message_bytes)"
    )


class _BoundedRecv:
    """Replaces a protocol stream's ``recv_data``: checks each message's length prefix.

    grpclib's ``recv_message`` asks for exactly 5 bytes (the prefix), then for the body.
    """

    def __init__(
        self,
        recv_data: Callable[[int], Awaitable[bytes]],
        limit: int,
        on_refused: Callable[[int], None],
    ) -> None:
        self.recv_data = recv_data
        self.limit = limit
        self.on_refused = on_refused
        self.body_next = False

    async def __call__(self, size: int) -> bytes:
        if self.body_next:
            self.body_next = False
            return await self.recv_data(size)
        data = await self.recv_data(size)
        if size == PREFIX and len(data) == PREFIX:
            length = too_large(data, self.limit)
            if length is not None:
                self.on_refused(length)
                raise MessageTooLarge(
                    grpclib.const.Status.RESOURCE_EXHAUSTED, _describe(length, self.limit)
                )
            self.body_next = True
        return data


def _peer_of(stream: Any) -> tuple[str, str]:
    """The peer's address and who its certificate says it is, for the refusal's log."""
    peer = getattr(stream, "peer", None)
    addr = peer.addr() if peer is not None else None
    where = "unknown"
    if addr:
        host, port = str(addr[0]), addr[1]
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    cert = peer.cert() if peer is not None else None
    if cert is None:
        return where, "unauthenticated"
    try:
        identity = read_identity(cert)
    except UnreadableIdentity:
        return where, "unreadable certificate"
    return where, f"{identity.role} {identity.name}"


def bound_stream(
    stream: Any, limit: int, method: str, on_refused: TooLargeHook | None = None
) -> None:
    """Bound the messages ``stream`` (a grpclib server or client stream) receives."""
    inner = stream._stream  # the HTTP/2 stream grpclib's recv_message reads from

    def refused(length: int) -> None:
        if on_refused is not None:
            where, who = _peer_of(stream)
            on_refused(method, where, who, length, limit)

    inner.recv_data = _BoundedRecv(inner.recv_data, limit, refused)


def bound_handlers(
    mapping: dict[str, grpclib.const.Handler], limit: int, on_refused: TooLargeHook | None = None
) -> dict[str, grpclib.const.Handler]:
    """The same handlers, each bounding what its stream receives before it runs."""

    def wrap(method: str, func: Callable[[Any], Awaitable[None]]) -> Any:
        async def handler(stream: Any) -> None:
            bound_stream(stream, limit, method, on_refused)
            await func(stream)

        return handler

    return {method: h._replace(func=wrap(method, h.func)) for method, h in mapping.items()}


def bound_channel_stream(
    stream: grpclib.client.Stream[Any, Any],
    limit: int,
    on_refused: TooLargeHook | None = None,
) -> None:
    """Bound a client stream: from the moment its request is sent (explicitly or not)."""
    send_request = stream.send_request
    method = stream._method_name

    async def bounded_send_request(*, end: bool = False) -> None:
        await send_request(end=end)
        bound_stream(stream, limit, method, on_refused)

    stream.send_request = bounded_send_request  # type: ignore[method-assign]


class BoundedChannel(grpclib.client.Channel):
    """A grpclib Channel whose every stream is bounded to ``max_message`` bytes received."""

    def __init__(
        self,
        *args: Any,
        max_message: int = DEFAULT_MAX_MESSAGE,
        on_refused: TooLargeHook | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.max_message = max_message
        self.on_refused = on_refused

    def request(self, *args: Any, **kwargs: Any) -> grpclib.client.Stream[Any, Any]:
        stream = super().request(*args, **kwargs)
        bound_channel_stream(stream, self.max_message, self.on_refused)
        return stream
