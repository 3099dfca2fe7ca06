"""High availability: one leader among several instances, on etcd or PostgreSQL.

etcd: the leader holds ``{prefix}/leader``, created in a transaction only if absent
and attached to a lease it keeps alive; the key's create revision is the epoch.
PostgreSQL: the leader holds a session advisory lock and bumps the epoch row of
``llmgw_leader``. Either way the leader renews (keep-alive, or a check of
``pg_locks``) every third of ``lease_ttl``; a renewal that fails or does not come
back before ``lease_ttl`` has passed since the last good one makes it step down at
once (``on_lost``): before the lease can have expired at the store, so no two
instances ever dispatch in the same moment. Standbys poll for the claim and know the
leader's advertised address, which they tell every agent and router they refuse.

The campaign and the renewals run on a thread of their own, with their own event
loop and their own etcd client or PostgreSQL session (the one that holds the lock):
a main loop busy with 10,000 agent streams cannot starve them. The main loop hears
of an election or a loss through ``call_soon_threadsafe``; dispatch does not wait for
that: it asks :meth:`Leadership.valid`, which is false from the moment the lead is
lost or the last good renewal is ``lease_ttl`` old, whatever the main loop is doing.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import structlog

from llmgw_control.config import HaSettings
from llmgw_control.store.base import StoreError

__all__ = ["Backend", "Leadership", "default_instance_id"]

T = TypeVar("T")
log = structlog.get_logger(__name__)


def default_instance_id(listen: str) -> str:
    return f"{socket.gethostname()}:{listen.rpartition(':')[2]}"


class Backend(Protocol):
    """One instance's hold on the lead. Every method runs on the renewal thread's loop.

    A backend may also have ``async open()`` and ``async close()``: its own
    connection, opened and closed on that loop.
    """

    async def acquire(self) -> int | None:
        """Become leader if nobody is: the new epoch, or None."""

    async def renew(self) -> bool:
        """Still the leader? (keeps the lease alive)"""

    async def leader(self) -> tuple[str, str] | None:
        """(instance id, advertised address) of the current leader, if any."""

    async def release(self) -> None:
        """Give the lead up (on a clean stop, so a standby takes over at once)."""


class Leadership:
    """Campaigns forever; calls ``on_elected(epoch)`` and ``on_lost()`` as the lead changes.

    ``run()`` (on the main loop) starts the renewal thread and waits; the callbacks are
    called on the main loop. ``valid()`` and ``step_down()`` may be called from anywhere.
    """

    def __init__(
        self,
        backend: Backend,
        settings: HaSettings,
        instance: str,
        address: str,
        on_elected: Callable[[int], Awaitable[None]],
        on_lost: Callable[[str], None],
        poll: float | None = None,
    ) -> None:
        self.backend = backend
        self.ttl = float(settings.lease_ttl)
        self.instance = instance
        self.address = address
        self.on_elected = on_elected
        self.on_lost = on_lost
        self.poll = poll if poll is not None else min(1.0, self.ttl / 5)
        self.leading = False
        self.epoch = 0
        # The leader's advertised address as last seen ("" = unknown).
        self.leader_address = ""
        self.leader_instance = ""
        # monotonic: the lead is certain until then (last good renewal asked + lease_ttl).
        self.valid_until = 0.0
        # Renewals that came back good, and the longest gap between two (seconds).
        self.renewals = 0
        self.longest_gap = 0.0
        self._last_good = 0.0
        self._lock = threading.Lock()
        self._term = 0
        # Serialises acquire and release on the renewal thread's loop.
        self._ops: asyncio.Lock | None = None
        self._main: asyncio.AbstractEventLoop | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._takeover: asyncio.Task[None] | None = None

    # --- anywhere -------------------------------------------------------------------

    def valid(self) -> bool:
        """May this instance dispatch now? False once lost or past the lease."""
        return self.leading and time.monotonic() < self.valid_until

    def step_down(self, why: str) -> None:
        """Give the lead up now (a fenced write, a failed takeover)."""
        if self._lose(why):
            loop = self._loop
            if loop is not None and not loop.is_closed():
                with contextlib.suppress(RuntimeError):
                    asyncio.run_coroutine_threadsafe(self._release(), loop)

    def _lose(self, why: str) -> bool:
        """Mark the lead lost (once) and tell the main loop; True if it was held."""
        with self._lock:
            if not self.leading:
                return False
            self.leading = False
            self.valid_until = 0.0
            self.leader_address = self.leader_instance = ""
        log.error("lost the lead; dispatching stopped", instance=self.instance, why=why)
        main = self._main
        if main is not None and not main.is_closed():
            with contextlib.suppress(RuntimeError):
                main.call_soon_threadsafe(self._lost_on_main, why)
        return True

    # --- the main loop --------------------------------------------------------------

    async def run(self) -> None:
        """Campaign (on the renewal thread) until cancelled."""
        self._main = main = asyncio.get_running_loop()
        failed: asyncio.Future[None] = main.create_future()
        self._thread = threading.Thread(
            target=self._thread_main, args=(failed,), name="llmgw-leadership", daemon=True
        )
        self._thread.start()
        try:
            await failed
        finally:
            await self._stop_thread()

    def _report(self, failed: asyncio.Future[None], err: BaseException | None) -> None:
        if not failed.done():
            if err is None:
                failed.set_result(None)
            else:
                failed.set_exception(err)

    def _elected_on_main(self, term: int, epoch: int) -> None:
        if term != self._term or not self.leading:
            return  # lost again before the main loop heard of it
        self._takeover = asyncio.get_running_loop().create_task(self._take(epoch))

    async def _take(self, epoch: int) -> None:
        try:
            await self.on_elected(epoch)
        except Exception as err:  # a failed takeover gives the lead back
            log.exception("takeover failed; giving the lead up")
            self.step_down(f"takeover failed: {err}")

    def _lost_on_main(self, why: str) -> None:
        takeover, self._takeover = self._takeover, None
        if takeover is not None and takeover is not asyncio.current_task():
            takeover.cancel()
        self.on_lost(why)

    async def resign(self) -> None:
        """A clean stop: hand the lead over now rather than at lease expiry."""
        with self._lock:
            held, self.leading = self.leading, False
            self.valid_until = 0.0
        loop = self._loop
        if held and loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError, StoreError, TimeoutError):
                done = asyncio.run_coroutine_threadsafe(self._release(), loop)
                await _within(asyncio.wrap_future(done), 3.0)
        await self._stop_thread()

    async def _stop_thread(self) -> None:
        thread, loop, stop = self._thread, self._loop, self._stop
        if thread is None:
            return
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        await asyncio.shield(asyncio.to_thread(thread.join, 10.0))
        self._thread = None

    # --- the renewal thread ---------------------------------------------------------

    def _thread_main(self, failed: asyncio.Future[None]) -> None:
        main = self._main
        assert main is not None
        err: BaseException | None = None
        try:
            asyncio.run(self._thread_run())
        except BaseException as exc:  # the main loop must hear of it: run() raises it
            err = exc
        finally:
            self._loop = None
        if not main.is_closed():
            with contextlib.suppress(RuntimeError):
                main.call_soon_threadsafe(self._report, failed, err)

    async def _thread_run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._ops = asyncio.Lock()
        opener = getattr(self.backend, "open", None)
        closer = getattr(self.backend, "close", None)
        work = asyncio.create_task(self._campaign_forever(opener))
        stop = asyncio.create_task(self._stop.wait())
        try:
            await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, stop):
                task.cancel()
            await asyncio.gather(work, stop, return_exceptions=True)
            failure = None if work.cancelled() else work.exception()
            if failure is not None:
                # Nothing renews any more: a loss like any other, and said loudly.
                log.error("leadership thread failed", error=repr(failure), exc_info=failure)
                held = self._lose(f"the renewal thread failed: {failure!r}")
            else:
                # Stopped: an instance still leading gives the lead up (a clean stop's
                # resign() did already). No on_lost: the owner asked for this.
                with self._lock:
                    held, self.leading = self.leading, False
                    self.valid_until = 0.0
            if held:
                await self._release()
            if closer is not None:
                with contextlib.suppress(Exception):
                    await _within(closer(), 2.0)
        if failure is not None:
            raise failure

    async def _campaign_forever(self, opener: Callable[[], Awaitable[None]] | None) -> None:
        while opener is not None:
            try:
                await _within(opener(), self.ttl)
                break
            except (StoreError, TimeoutError) as err:
                log.warning("leader election: store unavailable", error=str(err) or "timeout")
                await asyncio.sleep(self.poll)
        while True:
            if self.leading:
                await self._hold()
            else:
                await self._campaign()

    async def _campaign(self) -> None:
        assert self._ops is not None
        try:
            async with self._ops:
                epoch = await _within(self.backend.acquire(), self.ttl)
        except (StoreError, TimeoutError) as err:
            log.warning("leader election: store unavailable", error=str(err) or "timeout")
            await asyncio.sleep(self.poll)
            return
        if epoch is None:
            with contextlib.suppress(StoreError, TimeoutError):
                current = await _within(self.backend.leader(), self.ttl)
                instance, address = current if current is not None else ("", "")
                if (instance, address) != (self.leader_instance, self.leader_address):
                    log.info("standing by", leader=instance or None, leader_address=address)
                self.leader_instance, self.leader_address = instance, address
            await asyncio.sleep(self.poll)
            return
        started = time.monotonic()
        with self._lock:
            self._term += 1
            term = self._term
            self.epoch = epoch
            self.valid_until = started + self.ttl
            self.leader_instance, self.leader_address = self.instance, self.address
            self.leading = True
        log.info("elected leader", instance=self.instance, epoch=epoch)
        self._last_good = started
        # The takeover (reading the whole state) runs on the main loop, beside the
        # renewals here: a large fleet's state may take longer to read than the lease.
        main = self._main
        assert main is not None
        main.call_soon_threadsafe(self._elected_on_main, term, epoch)

    async def _hold(self) -> None:
        await asyncio.sleep(self.ttl / 3)
        if not self.leading:
            return
        asked = time.monotonic()
        left = self.valid_until - asked
        since = asked - self._last_good
        if left <= 0:
            # This instance (its renewal thread) did not run in time: frozen, starved.
            ok, why = (
                False,
                (
                    f"the lease deadline passed before a renewal was sent ({since:.3g}s since "
                    f"the last good one, lease {self.ttl:g}s): this instance was held up"
                ),
            )
        else:
            try:
                ok = await _within(self.backend.renew(), left)
                why = "the store says this instance no longer leads"
            except TimeoutError:
                ok, why = False, f"no renewal within the lease ({self.ttl:g}s)"
            except StoreError as err:
                ok, why = False, f"renewal failed: {err}"
            if ok and time.monotonic() >= self.valid_until:
                ok, why = (
                    False,
                    (
                        f"the lease deadline passed before the renewal came back (it took "
                        f"{time.monotonic() - asked:.3g}s, lease {self.ttl:g}s)"
                    ),
                )
        if ok:
            with self._lock:
                if self.leading:
                    self.valid_until = asked + self.ttl
                    self.renewals += 1
                    self.longest_gap = max(self.longest_gap, asked - self._last_good)
                    self._last_good = asked
            return
        if self._lose(why):
            await self._release()
        await asyncio.sleep(self.poll)

    async def _release(self) -> None:
        assert self._ops is not None
        async with self._ops:
            with contextlib.suppress(StoreError, TimeoutError):
                await _within(self.backend.release(), 2.0)


async def _within(call: Awaitable[T], seconds: float) -> T:
    """``call`` with a deadline (TimeoutError past it).

    Not ``asyncio.wait_for``: on Python 3.11 it loses a cancellation that arrives as the
    call completes, and a cancelled ``Leadership.run`` then campaigns on forever (seen
    under load in the store tests).
    """
    async with asyncio.timeout(seconds):
        return await call
