"""PostgreSQL (through asyncpg): records in one table, the leader's claim in another.

With a leader (:class:`PostgresBackend`, for :mod:`llmgw_control.leadership`), the
session advisory lock is held by the leadership's own session (on its renewal thread); each write transaction first checks,
in ``pg_locks``, that this session (by its server pid) still holds the lock, and that
the epoch row still has this leader's epoch (read ``FOR SHARE``: a new leader's bump
waits for the write, or the write sees the bump): a deposed leader cannot write.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import structlog

from llmgw_control.config import PostgresSettings
from llmgw_control.store.base import (
    SCHEMA_VERSION,
    Change,
    NotLeader,
    Records,
    StoreError,
    check_schema,
    group,
)

__all__ = ["LOCK_KEY", "PostgresBackend", "PostgresStore"]

log = structlog.get_logger(__name__)

# The advisory lock of the leader: one fixed 64-bit key ("llmgwctl").
LOCK_KEY = 0x6C6C6D6777637463

SCHEMA = """
CREATE TABLE IF NOT EXISTS llmgw_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS llmgw_records (
    kind TEXT NOT NULL, key TEXT NOT NULL, value BYTEA NOT NULL, PRIMARY KEY (kind, key));
CREATE TABLE IF NOT EXISTS llmgw_leader (
    id INT PRIMARY KEY CHECK (id = 1), epoch BIGINT NOT NULL,
    instance TEXT NOT NULL, address TEXT NOT NULL, since TIMESTAMPTZ NOT NULL DEFAULT now());
"""

HELD = (
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
    " AND pid = pg_backend_pid() AND classid = $1 AND objid = $2 AND objsubid = 1"
)
# The same, for the session with server pid $3 (the leadership's, not this one).
HELD_BY = (
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
    " AND pid = $3 AND classid = $1 AND objid = $2 AND objsubid = 1"
)
EPOCH = "SELECT epoch FROM llmgw_leader WHERE id = 1 FOR SHARE"


def lock_parts() -> tuple[int, int]:
    """pg_locks shows a bigint advisory key as (classid, objid): high and low 32 bits."""
    return (LOCK_KEY >> 32) & 0xFFFFFFFF, LOCK_KEY & 0xFFFFFFFF


class PostgresStore:
    def __init__(self, settings: PostgresSettings, setting: str = "state.postgres.dsn") -> None:
        self.settings = settings
        self.setting = setting
        self.description = f"postgres store {_redacted(settings.dsn)} ({setting})"
        self.conn: Any = None
        # With HA, every write first verifies that the leadership's session holds the
        # leader lock: (its server pid, the epoch it took), set while this instance leads.
        self.ha = False
        self.fence: tuple[int, int] | None = None

    async def connect(self) -> Any:
        password = None
        if self.settings.password_file:
            try:
                password = _read(self.settings.password_file)
            except OSError as err:
                raise StoreError(
                    f"{self.description}: state.postgres.password_file "
                    f"{self.settings.password_file}: {err.strerror or err}"
                ) from None
        try:
            return await asyncpg.connect(
                self.settings.dsn, password=password, timeout=float(self.settings.timeout)
            )
        except asyncpg.InvalidPasswordError as err:
            raise StoreError(
                f"{self.description}: PostgreSQL refused the password "
                f"(state.postgres.dsn / password_file): {err}"
            ) from None
        except asyncpg.InvalidAuthorizationSpecificationError as err:
            raise StoreError(f"{self.description}: PostgreSQL refused the user: {err}") from None
        except asyncpg.InvalidCatalogNameError as err:
            raise StoreError(f"{self.description}: no such database: {err}") from None
        except (asyncpg.PostgresError, OSError, TimeoutError, ValueError) as err:
            raise StoreError(
                f"{self.description}: PostgreSQL cannot be reached: {err or type(err).__name__}"
            ) from None

    async def open(self) -> None:
        self.conn = await self.connect()
        try:
            exists = await self.conn.fetchval("SELECT to_regclass('llmgw_meta') IS NOT NULL")
            version = None
            if exists:
                raw = await self.conn.fetchval("SELECT value FROM llmgw_meta WHERE name='schema'")
                version = int(raw) if raw is not None else None
            check_schema(self.description, version, self.setting)
            if version is None:
                async with self.conn.transaction():
                    # One instance creates the tables; the others wait on this lock.
                    await self.conn.execute("SELECT pg_advisory_xact_lock($1)", LOCK_KEY - 1)
                    await self.conn.execute(SCHEMA)
                    await self.conn.execute(
                        "INSERT INTO llmgw_meta (name, value) VALUES ('schema', $1)"
                        " ON CONFLICT (name) DO NOTHING",
                        str(SCHEMA_VERSION),
                    )
        except asyncpg.PostgresError as err:
            raise StoreError(f"{self.description}: {err}") from None

    async def _conn(self) -> Any:
        """The store's connection, made again if it broke (a standby elected later)."""
        if self.conn is None or self.conn.is_closed():
            self.conn = await self.connect()
        return self.conn

    async def load(self) -> Records:
        try:
            conn = await self._conn()
            rows = await conn.fetch("SELECT kind, key, value FROM llmgw_records")
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as err:
            raise StoreError(f"{self.description}: {err}") from None
        out: Records = {}
        for row in rows:
            out.setdefault(row["kind"], {})[row["key"]] = bytes(row["value"])
        return out

    async def write(self, changes: Sequence[Change]) -> None:
        net = group(changes)
        puts = [(k, key, v) for (k, key), v in net.items() if v is not None]
        dels = [(k, key) for (k, key), v in net.items() if v is None]
        fence = self.fence
        if self.ha and fence is None:
            raise NotLeader(f"{self.description}: this instance does not lead")
        try:
            conn = await self._conn()
            async with conn.transaction():
                if fence is not None:
                    pid, epoch = fence
                    if await conn.fetchval(HELD_BY, *lock_parts(), pid) != 1:
                        raise NotLeader(f"{self.description}: the leader lock was lost")
                    if await conn.fetchval(EPOCH) != epoch:
                        raise NotLeader(f"{self.description}: a newer leader took the lock")
                if puts:
                    await conn.executemany(
                        "INSERT INTO llmgw_records (kind, key, value) VALUES ($1, $2, $3)"
                        " ON CONFLICT (kind, key) DO UPDATE SET value = excluded.value",
                        puts,
                    )
                if dels:
                    await conn.executemany(
                        "DELETE FROM llmgw_records WHERE kind = $1 AND key = $2", dels
                    )
        except NotLeader:
            raise
        except StoreError:
            if self.ha:
                raise NotLeader(f"{self.description}: the store cannot be reached") from None
            raise
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as err:
            if self.ha:
                # The session (and with it the lock) may be gone: not the leader any more.
                raise NotLeader(f"{self.description}: write failed as leader: {err}") from None
            raise StoreError(f"{self.description}: write failed: {err}") from None

    async def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                await self.conn.close(timeout=2)
            self.conn = None


def _redacted(dsn: str) -> str:
    """The DSN without its password, for messages."""
    scheme, sep, rest = dsn.partition("://")
    if not sep or "@" not in rest:
        return dsn
    creds, _, host = rest.rpartition("@")
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}@{host}"


def _read(path: str) -> str:
    return Path(path).read_text().strip()


class PostgresBackend:
    """Leadership on PostgreSQL: the advisory lock, on a session of its own.

    A :class:`llmgw_control.leadership.Backend`: every method runs on the renewal
    thread's loop.

    The store's connection (on the main loop) writes the records; each write first
    checks that this backend's session (``store.fence``: its server pid and the epoch)
    still holds the lock and that no newer epoch was taken.
    """

    def __init__(self, store: PostgresStore, instance: str, address: str, ttl: float = 0.0) -> None:
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
