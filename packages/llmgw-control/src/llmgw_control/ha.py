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
import json
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import asyncpg  # type: ignore[import-untyped]
import structlog

from llmgw_control.config import HaSettings
from llmgw_control.store.base import StoreError

__all__ = ["Backend", "EtcdBackend", "Leadership", "PostgresBackend", "default_instance_id"]

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


class EtcdBackend:
    """The lease and the leader key, through an etcd client of its own.

    The store's client (on the main loop) writes the records, each write fenced on
    the claim this backend puts in ``store.fence``.
    """

    def __init__(self, store: Any, instance: str, address: str, ttl: float) -> None:
        from llmgw_control.store.etcd import EtcdStore

        assert isinstance(store, EtcdStore)
        self.store = store
        store.ha = True
        self.instance = instance
        self.address = address
        self.ttl = max(round(ttl), 1)
        self.key = store.key("leader")
        self.lease: Any = None
        # This backend's own connection (opened on the renewal thread's loop); until
        # then, the store's (tests drive a backend from one loop).
        self.own: EtcdStore | None = None

    @property
    def session(self) -> Any:
        return self.own if self.own is not None else self.store

    async def open(self) -> None:
        from llmgw_control.store.etcd import EtcdStore

        own = EtcdStore(self.store.settings, self.store.setting)
        await own.open()
        self.own = own

    async def close(self) -> None:
        own, self.own = self.own, None
        if own is not None:
            await own.close()

    async def acquire(self) -> int | None:
        session = self.session
        client = session.client
        t = client.transactions
        epoch_key = self.store.key("epoch")
        prev = await session._call(client.get(epoch_key))
        # Never below the wall clock's seconds, never below the last epoch + 1: newer than
        # any epoch an agent saw, even from a control plane whose store was replaced.
        epoch = max(int(prev.value) + 1 if prev is not None else 1, int(time.time()))
        lease = await session._call(client.lease(self.ttl))
        claim = json.dumps(
            {"instance": self.instance, "address": self.address, "lease": lease.id, "epoch": epoch}
        ).encode()
        unchanged = (
            t.mod(epoch_key) == prev.mod_revision if prev is not None else t.version(epoch_key) == 0
        )
        ok, _ = await session._call(
            client.transaction(
                compare=[t.create(self.key) == 0, unchanged],
                success=[
                    t.put(self.key, claim, lease=lease),
                    t.put(epoch_key, str(epoch).encode()),
                ],
                failure=[],
            )
        )
        if not ok:
            with contextlib.suppress(StoreError):
                await session._call(client.revoke_lease(lease.id))
            return None
        self.lease = lease
        self.store.fence = (self.key, claim)
        return epoch

    async def renew(self) -> bool:
        if self.lease is None:
            return False
        session = self.session
        reply = await session._call(session.client.refresh_lease(self.lease.id))
        return reply is not None and int(reply.TTL) > 0

    async def leader(self) -> tuple[str, str] | None:
        session = self.session
        got = await session._call(session.client.get(self.key))
        if got is None:
            return None
        claim = json.loads(bytes(got.value))
        return str(claim["instance"]), str(claim["address"])

    async def release(self) -> None:
        lease, self.lease = self.lease, None
        self.store.fence = None
        if lease is not None:
            session = self.session
            with contextlib.suppress(StoreError):
                await session._call(session.client.revoke_lease(lease.id))


class PostgresBackend:
    """The advisory lock, on a PostgreSQL session of its own.

    The store's connection (on the main loop) writes the records; each write first
    checks that this backend's session (``store.fence``: its server pid and the epoch)
    still holds the lock and that no newer epoch was taken.
    """

    def __init__(self, store: Any, instance: str, address: str, ttl: float = 0.0) -> None:
        from llmgw_control.store.postgres import PostgresStore

        assert isinstance(store, PostgresStore)
        self.store = store
        store.ha = True
        self.instance = instance
        self.address = address
        # The lease: the server ends this session when idle for that long (see _conn).
        self.ttl = ttl
        self.conn: Any = None

    async def open(self) -> None:
        """Nothing to do: the session is made on first use, on the loop that uses it."""

    async def close(self) -> None:
        await self._drop()

    async def _conn(self) -> Any:
        if self.conn is None or self.conn.is_closed():
            conn = await self.store.connect()
            if self.ttl > 0:
                # A frozen (SIGSTOP) or hung leader keeps its session open, and with it the
                # lock: no standby could take over until it resumed. The server ends a
                # session idle for a lease (PostgreSQL 14+), which frees the lock; a live
                # instance uses its session every third of one.
                try:
                    await conn.execute(
                        f"SET idle_session_timeout = {max(1, round(self.ttl * 1000))}"
                    )
                except asyncpg.PostgresError as err:
                    log.warning(
                        "idle_session_timeout not set: a frozen leader keeps the lead "
                        "until it resumes",
                        error=str(err),
                    )
            self.conn = conn
        return self.conn

    async def acquire(self) -> int | None:
        from llmgw_control.store.postgres import LOCK_KEY

        try:
            conn = await self._conn()
            if not await conn.fetchval("SELECT pg_try_advisory_lock($1)", LOCK_KEY):
                return None
            epoch = await conn.fetchval(
                "INSERT INTO llmgw_leader (id, epoch, instance, address)"
                " VALUES (1, extract(epoch from now())::bigint, $1, $2)"
                " ON CONFLICT (id) DO UPDATE SET epoch = GREATEST(llmgw_leader.epoch + 1,"
                " extract(epoch from now())::bigint),"
                " instance = excluded.instance, address = excluded.address, since = now()"
                " RETURNING epoch",
                self.instance,
                self.address,
            )
            self.store.fence = (int(conn.get_server_pid()), int(epoch))
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as err:
            await self._drop()
            raise StoreError(f"{self.store.description}: {err}") from None
        return int(epoch)

    async def renew(self) -> bool:
        from llmgw_control.store.postgres import HELD, lock_parts

        try:
            conn = await self._conn()
            return bool(await conn.fetchval(HELD, *lock_parts()) == 1)
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as err:
            raise StoreError(f"{self.store.description}: {err}") from None

    async def leader(self) -> tuple[str, str] | None:
        try:
            conn = await self._conn()
            row = await conn.fetchrow("SELECT instance, address FROM llmgw_leader WHERE id = 1")
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as err:
            await self._drop()
            raise StoreError(f"{self.store.description}: {err}") from None
        return (str(row["instance"]), str(row["address"])) if row else None

    async def _drop(self) -> None:
        # A session that may still hold the lock is closed: the lock goes with it.
        self.store.fence = None
        conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.terminate()

    async def release(self) -> None:
        await self._drop()


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


LEADER_METADATA = "llmgw-leader"


class LeaderGate:
    """Wraps gRPC services so that only the leader serves them.

    A standby answers every call with UNAVAILABLE and the leader's address in the
    trailing metadata ``llmgw-leader`` (left out while no leader is known); when the
    lead is lost, every call in progress (agent streams, watches) is ended so its
    client finds the new leader.
    """

    def __init__(
        self, services: list[Any], is_leader: Callable[[], bool], leader: Callable[[], str]
    ):
        self.services = services
        self.is_leader = is_leader
        self.leader = leader
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
            if not self.is_leader() and not _admitted_anyway(func):
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


def _admitted_anyway(func: Callable[[Any], Awaitable[None]]) -> bool:
    """TEST ONLY: agent streams taken by a non-leader (see agent_service.deposed_sends_anyway)."""
    from llmgw_control.agent_service import AgentService, deposed_sends_anyway

    return isinstance(getattr(func, "__self__", None), AgentService) and deposed_sends_anyway()
