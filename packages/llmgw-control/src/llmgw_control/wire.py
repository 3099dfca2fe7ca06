"""Reading messages off a gRPC stream when the peer may send anything.

grpclib raises whatever its framing or decoding trips over (``NotImplementedError:
Compression not implemented``, ``AssertionError: Received less data than expected``,
a protobuf decoder's ``KeyError`` or ``ValueError``), and an exception that leaves a
handler is logged by grpclib at error level with its traceback and without the
peer. A malformed frame is the peer's mistake, not ours: :func:`recv` turns it into
one warning line naming the peer, the method and the reason, and ends the stream
with ``INVALID_ARGUMENT``, which grpclib sends without logging anything.
"""

from __future__ import annotations

from typing import Any, TypeVar

import grpclib.const
import grpclib.server
import structlog
from grpclib.exceptions import GRPCError, StreamTerminatedError

__all__ = ["MalformedMessage", "peer_of", "recv"]

log = structlog.get_logger(__name__)

T = TypeVar("T")


class MalformedMessage(GRPCError):
    """The peer sent bytes that are not a message of the stream's type."""


def peer_of(stream: grpclib.server.Stream[Any, Any]) -> str:
    addr = stream.peer.addr() if stream.peer is not None else None
    if not addr:
        return "unknown"
    host, port = str(addr[0]), addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def recv(stream: grpclib.server.Stream[T, Any], what: str) -> T | None:
    """The next message, None at the end of the stream; MalformedMessage if it is not one.

    ``what`` names the stream in the log line (e.g. ``agent stream``).
    """
    try:
        return await stream.recv_message()
    except (GRPCError, StreamTerminatedError):
        raise
    except (
        NotImplementedError,
        AssertionError,
        KeyError,
        ValueError,
        TypeError,
        IndexError,
    ) as err:
        reason = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        log.warning("malformed gRPC message", stream=what, peer=peer_of(stream), reason=reason)
        raise MalformedMessage(
            grpclib.const.Status.INVALID_ARGUMENT, f"malformed message on the {what}: {reason}"
        ) from None
