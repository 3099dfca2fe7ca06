"""Issue 24 point 14: a leader stepping down says why in one line, and ends its streams
without a traceback.

The reason is the true one: a lease deadline that passed while this instance was held
up (frozen, starved) is not "the store says this instance no longer leads". Ending the
calls in progress logs one line each, even when the peer resets the stream while the
handler is still cleaning up (grpclib logged "Failed to handle cancellation" at error
level, with a traceback, when the gate swallowed grpclib's own cancellation).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import grpclib.client
import grpclib.const
import grpclib.server
import pytest
from grpclib.exceptions import GRPCError
from llmgw_control.config import HaSettings
from llmgw_control.leader_gate import LEADER_METADATA, LeaderGate
from llmgw_control.leadership import Leadership
from llmgw_proto import v1
from llmgw_testkit import free_port, wait_for_async
from structlog.testing import capture_logs

TTL = 1.0


class Backend:
    """A leadership backend that is always renewed, unless told to take its time."""

    def __init__(self) -> None:
        self.slow = 0.0

    async def acquire(self) -> int | None:
        return 7

    async def renew(self) -> bool:
        if self.slow:
            time.sleep(self.slow)  # noqa: ASYNC251 (the renewal thread held, as if frozen)
        return True

    async def leader(self) -> tuple[str, str] | None:
        return None

    async def release(self) -> None:
        return None


def _async(fn: Any) -> Any:
    async def probe() -> Any:
        return fn()

    return probe


@pytest.mark.parametrize("held", ["between renewals", "during a renewal"])
async def test_a_lease_deadline_passed_is_said_as_such(held: str) -> None:
    backend = Backend()
    lost: list[str] = []
    elected: list[int] = []

    async def on_elected(epoch: int) -> None:
        elected.append(epoch)

    lead = Leadership(
        backend,
        HaSettings(backend="etcd", lease_ttl=TTL),  # type: ignore[arg-type]
        "a",
        "127.0.0.1:1",
        on_elected,
        lost.append,
        poll=0.05,
    )
    task = asyncio.create_task(lead.run())
    try:
        with capture_logs() as logs:
            await wait_for_async(_async(lambda: lead.renewals >= 2), what="renewing")
            if held == "between renewals":
                # The renewal thread's loop does not run for three leases (SIGSTOP).
                loop = lead._loop
                assert loop is not None
                loop.call_soon_threadsafe(time.sleep, 3 * TTL)
            else:
                backend.slow = 2 * TTL
            await wait_for_async(_async(lambda: lost), timeout=20, what="stepped down")
        assert "lease deadline passed" in lost[0]
        assert "store says" not in lost[0]
        lines = [e for e in logs if e["event"].startswith("lost the lead")]
        assert len(lines) == 1, logs
        assert lines[0]["why"] == lost[0]
        assert lines[0]["log_level"] == "error"
        assert "exc_info" not in lines[0]
        # Renewed: "the store says" is kept for a store that does say so.
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class OneWatch:
    """A service of one streaming call, PATH, handled by ``watch``."""

    PATH = "/test.Slow/Watch"

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            self.PATH: grpclib.const.Handler(
                self.watch,
                grpclib.const.Cardinality.STREAM_STREAM,
                v1.WatchRequest,
                v1.EndpointSnapshot,
            )
        }

    async def watch(self, stream: Any) -> None:
        raise NotImplementedError


class SlowCleanup(OneWatch):
    """A server-streaming call whose handler cleans up with awaits (as the agent stream
    does: it awaits its send and receive tasks), during which a peer's reset lands."""

    def __init__(self, peer_resets: bool) -> None:
        self.started = asyncio.Event()
        self.cleanup = asyncio.Event()
        self.interrupted = asyncio.Event()
        if not peer_resets:
            self.cleanup.set()

    async def watch(self, stream: Any) -> None:
        await stream.recv_message()
        self.started.set()
        try:
            await asyncio.Event().wait()
        finally:
            sub = asyncio.ensure_future(self.cleanup.wait())
            with contextlib.suppress(BaseException):
                await sub
            if sub.cancelled():
                self.interrupted.set()


def _handlers_done(server: grpclib.server.Server) -> bool:
    tasks = [t for h in server._handlers for t in [*h._tasks.values(), *h._cancelled]]
    return all(t.done() for t in tasks)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)  # (handle() holds the handler's lock)


@pytest.mark.parametrize("peer_resets", [True, False])
async def test_ending_streams_on_step_down_logs_one_line_and_no_traceback(
    peer_resets: bool,
) -> None:
    leading = [True]
    service = SlowCleanup(peer_resets)
    gate = LeaderGate([service], lambda: leading[0], lambda: "127.0.0.1:7171")
    server = grpclib.server.Server([gate])
    port = free_port()
    await server.start("127.0.0.1", port)
    channel = grpclib.client.Channel("127.0.0.1", port)
    grpclib_logs = Records()
    grpclib_logger = logging.getLogger("grpclib")
    grpclib_logger.addHandler(grpclib_logs)
    try:
        closed: GRPCError | None = None
        with capture_logs() as logs:
            try:
                async with channel.request(
                    SlowCleanup.PATH,
                    grpclib.const.Cardinality.STREAM_STREAM,
                    v1.WatchRequest,
                    v1.EndpointSnapshot,
                ) as stream:
                    await stream.send_message(v1.WatchRequest(router_id="r"))
                    await asyncio.wait_for(service.started.wait(), 30)
                    why = "the lease deadline passed before a renewal was sent (test)"
                    leading[0] = False
                    gate.end_all(why)
                    if peer_resets:
                        # The peer gives the stream up while the handler still cleans up.
                        await stream.cancel()
                        await asyncio.wait_for(service.interrupted.wait(), 30)
                    else:
                        with pytest.raises(GRPCError) as err:
                            await stream.recv_message()
                        assert err.value.status == grpclib.const.Status.UNAVAILABLE
                        trailers = dict(stream.trailing_metadata or {})
                        assert trailers.get(LEADER_METADATA) == "127.0.0.1:7171"
            except GRPCError as exc:  # the stream's status, raised again as it closes
                closed = exc
            if closed is not None:
                assert not peer_resets
                assert closed.status == grpclib.const.Status.UNAVAILABLE
            await wait_for_async(_async(lambda: not gate._calls), what="the call ended")
            # grpclib logs what the handler's end was after it: wait for its tasks too.
            await wait_for_async(_async(lambda: _handlers_done(server)), what="handlers done")
        ended = [e for e in logs if e["event"] == "call ended: this instance no longer leads"]
        assert len(ended) == 1, logs
        assert ended[0]["why"] == why
        assert ended[0]["log_level"] == "info"
        assert not [e for e in logs if e["log_level"] in ("error", "critical")], logs
        errors = [r for r in grpclib_logs.records if r.levelno >= logging.ERROR]
        assert errors == [], [(r.getMessage(), r.exc_info) for r in errors]
    finally:
        grpclib_logger.removeHandler(grpclib_logs)
        channel.close()
        server.close()
        await server.wait_closed()


class WriteAfterLoss(OneWatch):
    """A server-streaming call whose write fails because its connection is gone: a leader
    resumed after a freeze writes to a TLS transport asyncio has already dropped (seen in
    the SIGSTOP test: AttributeError '_write_appdata' from the load watch's send)."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.failed = asyncio.Event()

    async def watch(self, stream: Any) -> None:
        await stream.recv_message()
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.failed.set()
            raise AttributeError("'NoneType' object has no attribute '_write_appdata'") from None


async def test_a_write_to_a_lost_connection_is_grpclibs_cancellation_not_an_error() -> None:
    service = WriteAfterLoss()
    gate = LeaderGate([service], lambda: True, lambda: "")
    server = grpclib.server.Server([gate])
    port = free_port()
    await server.start("127.0.0.1", port)
    channel = grpclib.client.Channel("127.0.0.1", port)
    grpclib_logs = Records()
    grpclib_logger = logging.getLogger("grpclib")
    grpclib_logger.addHandler(grpclib_logs)
    try:
        async with channel.request(
            WriteAfterLoss.PATH,
            grpclib.const.Cardinality.STREAM_STREAM,
            v1.WatchRequest,
            v1.EndpointSnapshot,
        ) as stream:
            await stream.send_message(v1.WatchRequest(router_id="r"))
            await asyncio.wait_for(service.started.wait(), 30)
            await stream.cancel()  # the peer is gone
        await asyncio.wait_for(service.failed.wait(), 30)
        await wait_for_async(_async(lambda: not gate._calls), what="the call ended")
        await wait_for_async(_async(lambda: _handlers_done(server)), what="handlers done")
        errors = [r for r in grpclib_logs.records if r.levelno >= logging.ERROR]
        assert errors == [], [(r.getMessage(), r.exc_info) for r in errors]
    finally:
        grpclib_logger.removeHandler(grpclib_logs)
        channel.close()
        server.close()
        await server.wait_closed()
