"""Only the leader serves: a standby refuses agent streams and watches with the
leader's address, and a lost lead ends every call in progress.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

__all__ = ["LEADER_METADATA", "LeaderGate"]

log = structlog.get_logger(__name__)

LEADER_METADATA = "llmgw-leader"


class LeaderGate:
    """Wraps gRPC services so that only the leader serves them.

    A standby answers every call with UNAVAILABLE and the leader's address in the
    trailing metadata ``llmgw-leader`` (left out while no leader is known); when the
    lead is lost, every call in progress (agent streams, watches) is ended so its
    client finds the new leader. ``admit_anyway(handler)``, when given, lets a standby
    take the calls of the handlers it says yes to (the wiring decides; by default none).
    """

    def __init__(
        self,
        services: list[Any],
        is_leader: Callable[[], bool],
        leader: Callable[[], str],
        admit_anyway: Callable[[Callable[[Any], Awaitable[None]]], bool] | None = None,
    ):
        self.services = services
        self.is_leader = is_leader
        self.leader = leader
        self.admit_anyway = admit_anyway
        self._calls: set[asyncio.Task[Any]] = set()
        # Calls end_all() cancelled, and why (a cancellation from elsewhere is no step-down).
        self._ending: dict[asyncio.Task[Any], str] = {}

    def __mapping__(self) -> dict[str, Any]:
        import grpclib.const

        out: dict[str, Any] = {}
        for service in self.services:
            for path, handler in service.__mapping__().items():
                out[path] = grpclib.const.Handler(
                    self._wrap(handler.func),
                    handler.cardinality,
                    handler.request_type,
                    handler.reply_type,
                )
        return out

    def _wrap(self, func: Callable[[Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
        async def gated(stream: Any) -> None:
            if not self.is_leader() and not (
                self.admit_anyway is not None and self.admit_anyway(func)
            ):
                await self.refuse(stream)
                return
            task = asyncio.current_task()
            assert task is not None
            self._calls.add(task)
            try:
                await func(stream)
            except asyncio.CancelledError:
                why = self._ending.pop(task, None)
                if why is None or self.is_leader():
                    raise  # not ended by end_all(): a server stop, grpclib's own
                # Ended because the lead was lost: say where to go instead, unless the
                # peer ended the stream meanwhile (then grpclib must see its own
                # cancellation, or it logs "Failed to handle cancellation").
                log.info(
                    "call ended: this instance no longer leads",
                    method=getattr(func, "__name__", "?"),
                    peer=_peer(stream),
                    why=why,
                    leader=self.leader() or None,
                )
                if not _terminated(stream):
                    with contextlib.suppress(Exception):
                        await self.refuse(stream)
                if _terminated(stream):
                    raise
            except Exception:
                # The peer ended the stream (a lost connection: a leader resumed after a
                # freeze writes to a transport that is gone) while the handler wrote to it:
                # the write's error is that loss, which grpclib is already handling; it
                # must see its own cancellation or it logs "Failed to handle cancellation".
                if _terminated(stream):
                    raise asyncio.CancelledError from None
                raise
            finally:
                self._calls.discard(task)
                self._ending.pop(task, None)

        return gated

    async def refuse(self, stream: Any) -> None:
        import grpclib.const

        address = self.leader()
        await stream.send_trailing_metadata(
            status=grpclib.const.Status.UNAVAILABLE,
            status_message=(
                f"not the leader; the leader is {address}"
                if address
                else "not the leader; no leader known yet"
            ),
            # No trailer while no leader is known (grpclib refuses an empty value).
            metadata={LEADER_METADATA: address} if address else None,
        )

    def end_all(self, why: str = "the lead was lost") -> None:
        """End every call in progress (the lead was lost): each says where to go."""
        for task in list(self._calls):
            self._ending[task] = why
            task.cancel()


def _terminated(stream: Any) -> bool:
    """Has the peer (a reset, a lost connection) ended ``stream``? grpclib then
    cancels the handler itself and expects that cancellation to come out of it."""
    wrapper = getattr(getattr(stream, "_stream", None), "wrapper", None)
    return bool(getattr(wrapper, "cancelled", False))


def _peer(stream: Any) -> str | None:
    peer = getattr(stream, "peer", None)
    with contextlib.suppress(Exception):
        addr = peer.addr() if peer is not None else None
        return f"{addr[0]}:{addr[1]}" if addr else None
    return None
