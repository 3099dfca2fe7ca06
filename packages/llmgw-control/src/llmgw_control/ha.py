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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
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
    async def acquire(self) -> int | None:
        """Become leader if nobody is: the new epoch, or None."""

    async def renew(self) -> bool:
        """Still the leader? (keeps the lease alive)"""

    async def leader(self) -> tuple[str, str] | None:
        """(instance id, advertised address) of the current leader, if any."""

    async def release(self) -> None:
        """Give the lead up (on a clean stop, so a standby takes over at once)."""


class EtcdBackend:
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

    async def acquire(self) -> int | None:
        client = self.store.client
        t = client.transactions
        epoch_key = self.store.key("epoch")
        prev = await self.store._call(client.get(epoch_key))
        # Never below the wall clock's seconds, never below the last epoch + 1: newer than
        # any epoch an agent saw, even from a control plane whose store was replaced.
        epoch = max(int(prev.value) + 1 if prev is not None else 1, int(time.time()))
        lease = await self.store._call(client.lease(self.ttl))
        claim = json.dumps(
            {"instance": self.instance, "address": self.address, "lease": lease.id, "epoch": epoch}
        ).encode()
        unchanged = (
            t.mod(epoch_key) == prev.mod_revision if prev is not None else t.version(epoch_key) == 0
        )
        ok, _ = await self.store._call(
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
                await self.store._call(client.revoke_lease(lease.id))
            return None
        self.lease = lease
        self.store.fence = (self.key, claim)
        return epoch

    async def renew(self) -> bool:
        if self.lease is None:
            return False
        reply = await self.store._call(self.store.client.refresh_lease(self.lease.id))
        return reply is not None and int(reply.TTL) > 0

    async def leader(self) -> tuple[str, str] | None:
        got = await self.store._call(self.store.client.get(self.key))
        if got is None:
            return None
        claim = json.loads(bytes(got.value))
        return str(claim["instance"]), str(claim["address"])

    async def release(self) -> None:
        lease, self.lease = self.lease, None
        self.store.fence = None
        if lease is not None:
            with contextlib.suppress(StoreError):
                await self.store._call(self.store.client.revoke_lease(lease.id))


class PostgresBackend:
    def __init__(self, store: Any, instance: str, address: str) -> None:
        from llmgw_control.store.postgres import PostgresStore

        assert isinstance(store, PostgresStore)
        self.store = store
        store.ha = True
        self.instance = instance
        self.address = address

    async def _conn(self) -> Any:
        if self.store.conn is None or self.store.conn.is_closed():
            self.store.conn = await self.store.connect()
        return self.store.conn

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
        conn, self.store.conn = self.store.conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.terminate()

    async def release(self) -> None:
        await self._drop()


class Leadership:
    """Campaigns forever; calls ``on_elected(epoch)`` and ``on_lost()`` as the lead changes."""

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
        self.valid_until = 0.0
        self._takeover: asyncio.Task[None] | None = None

    async def run(self) -> None:
        while True:
            if self.leading:
                await self._hold()
            else:
                await self._campaign()

    async def _campaign(self) -> None:
        try:
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
        self.leading = True
        self.epoch = epoch
        self.valid_until = started + self.ttl
        self.leader_instance, self.leader_address = self.instance, self.address
        log.info("elected leader", instance=self.instance, epoch=epoch)
        # The takeover (reading the whole state) runs beside the renewals: a large
        # fleet's state may take longer to read than the lease lasts.
        self._takeover = asyncio.create_task(self._take(epoch))

    async def _take(self, epoch: int) -> None:
        try:
            await self.on_elected(epoch)
        except Exception as err:  # a failed takeover gives the lead back
            log.exception("takeover failed; giving the lead up")
            await self._step_down(f"takeover failed: {err}")

    async def _hold(self) -> None:
        await asyncio.sleep(self.ttl / 3)
        asked = time.monotonic()
        left = self.valid_until - asked
        try:
            ok = left > 0 and await _within(self.backend.renew(), left)
            why = "the store says this instance no longer leads"
        except TimeoutError:
            ok, why = False, f"no renewal within the lease ({self.ttl:g}s)"
        except StoreError as err:
            ok, why = False, f"renewal failed: {err}"
        if ok and time.monotonic() < self.valid_until:
            self.valid_until = asked + self.ttl
            return
        await self._step_down(why)

    async def _step_down(self, why: str) -> None:
        if not self.leading:
            return
        self.leading = False
        takeover, self._takeover = self._takeover, None
        if takeover is not None and takeover is not asyncio.current_task():
            takeover.cancel()
        self.leader_address = self.leader_instance = ""
        log.error("lost the lead; dispatching stopped", instance=self.instance, why=why)
        self.on_lost(why)
        with contextlib.suppress(StoreError, TimeoutError):
            await _within(self.backend.release(), 2.0)

    async def resign(self) -> None:
        """A clean stop: hand the lead over now rather than at lease expiry."""
        if self.leading:
            self.leading = False
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
            if not self.is_leader():
                await self.refuse(stream)
                return
            task = asyncio.current_task()
            assert task is not None
            self._calls.add(task)
            try:
                await func(stream)
            except asyncio.CancelledError:
                if self.is_leader():
                    raise
                # Ended because the lead was lost: say where to go instead.
                with contextlib.suppress(Exception):
                    await self.refuse(stream)
            finally:
                self._calls.discard(task)

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

    def end_all(self) -> None:
        for task in list(self._calls):
            task.cancel()
