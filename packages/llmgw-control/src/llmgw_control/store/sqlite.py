"""The embedded default: one SQLite file (WAL) under ``state.state_dir``.

All SQLite work runs on one thread of its own, so the event loop never waits on the
disk; the control plane hands it whole batches (one transaction each).

One control plane per directory: ``open`` takes an exclusive ``flock`` on
``<state_dir>/LOCK`` (the holder's pid written in it) and keeps it until ``close`` or
the process's end, as etcd, PostgreSQL and Prometheus do with their data directories;
a second control plane on the same directory is refused, naming the holder.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import sqlite3
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from llmgw_control.store.base import (
    SCHEMA_VERSION,
    Change,
    Records,
    StoreError,
    check_schema,
    group,
)

__all__ = ["APPLICATION_ID", "SqliteStore"]

# PRAGMA application_id: marks the file as ours ("LGWC").
APPLICATION_ID = 0x4C475743
FILE_NAME = "control.db"
LOCK_NAME = "LOCK"

T = TypeVar("T")


class SqliteStore:
    def __init__(self, state_dir: Path, setting: str = "state.state_dir") -> None:
        self.path = state_dir / FILE_NAME
        self.setting = setting
        self.description = f"sqlite store {self.path} ({setting})"
        self._db: sqlite3.Connection | None = None
        self._lock_fd: int | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmgw-sqlite")

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def open(self) -> None:
        await self._run(self._open)

    def _open(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StoreError(
                f"{self.description}: cannot create the directory: {err.strerror or err}"
            ) from None
        self._lock()
        try:
            self._db = self._connect()
        except BaseException:
            self._unlock()
            raise

    def _lock(self) -> None:
        """Hold ``<state_dir>/LOCK`` exclusively, or say who does."""
        lock = self.path.parent / LOCK_NAME
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise StoreError(
                f"{self.description}: cannot open the lock file {lock}: {err.strerror or err}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            raise StoreError(
                f"state directory {self.path.parent} ({self.setting}) is in use by another "
                f"llmgw-control (pid {holder or 'unknown'}, holding {lock}); stop it, or give "
                f"this one its own {self.setting}"
            ) from None
        except OSError as err:
            os.close(fd)
            raise StoreError(
                f"{self.description}: cannot lock {lock}: {err.strerror or err}"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _unlock(self) -> None:
        # The file stays (removing it would race a newcomer's open); the lock goes.
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)

    def _connect(self) -> sqlite3.Connection:
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        try:
            # The state holds each engine's secret: the owner's alone (SQLite gives its
            # -wal and -shm files the database file's mode).
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.fchmod(fd, 0o600)
            finally:
                os.close(fd)
        except OSError as err:
            raise StoreError(f"{self.description}: cannot open: {err.strerror or err}") from None
        try:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as err:
            raise StoreError(f"{self.description}: cannot open: {err}") from None
        try:
            self._check(db, fresh)
        except sqlite3.DatabaseError as err:
            db.close()
            raise StoreError(f"{self.description}: cannot be read: {err}") from None
        except StoreError:
            db.close()
            raise
        return db

    def _check(self, db: sqlite3.Connection, fresh: bool) -> None:
        app = db.execute("PRAGMA application_id").fetchone()[0]
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not fresh and app != APPLICATION_ID and tables:
            raise StoreError(
                f"{self.description}: is not an llmgw-control state file (an SQLite file of "
                f"something else); point {self.setting} elsewhere"
            )
        if not fresh:
            problems = [r[0] for r in db.execute("PRAGMA quick_check")]
            if problems != ["ok"]:
                raise StoreError(f"{self.description}: is damaged: {'; '.join(problems[:3])}")
        version = int(db.execute("PRAGMA user_version").fetchone()[0])
        check_schema(self.description, version if version else None, self.setting)
        db.execute("PRAGMA journal_mode=WAL")
        # WAL with synchronous=NORMAL stays consistent after a crash; the last batch or
        # two may be lost on power loss, which the agents' registrations make up for.
        db.execute("PRAGMA synchronous=NORMAL")
        if not version:
            db.execute("BEGIN IMMEDIATE")
            db.execute(
                "CREATE TABLE IF NOT EXISTS records ("
                " kind TEXT NOT NULL, key TEXT NOT NULL, value BLOB NOT NULL,"
                " PRIMARY KEY (kind, key)) WITHOUT ROWID"
            )
            db.execute(f"PRAGMA application_id={APPLICATION_ID}")
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            db.execute("COMMIT")

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise StoreError(f"{self.description}: not open")
        return self._db

    async def load(self) -> Records:
        return await self._run(self._load)

    def _load(self) -> Records:
        out: Records = {}
        try:
            for kind, key, value in self._conn().execute("SELECT kind, key, value FROM records"):
                out.setdefault(kind, {})[key] = bytes(value)
        except sqlite3.DatabaseError as err:
            raise StoreError(f"{self.description}: cannot be read: {err}") from None
        return out

    async def write(self, changes: Sequence[Change]) -> None:
        if changes:
            await self._run(lambda: self._write(changes))

    def _write(self, changes: Sequence[Change]) -> None:
        net = group(changes)
        puts = [(k, key, v) for (k, key), v in net.items() if v is not None]
        dels = [(k, key) for (k, key), v in net.items() if v is None]
        db = self._conn()
        try:
            db.execute("BEGIN")
            if puts:
                db.executemany(
                    "INSERT INTO records (kind, key, value) VALUES (?, ?, ?)"
                    " ON CONFLICT (kind, key) DO UPDATE SET value = excluded.value",
                    puts,
                )
            if dels:
                db.executemany("DELETE FROM records WHERE kind = ? AND key = ?", dels)
            db.execute("COMMIT")
        except sqlite3.Error as err:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise StoreError(f"{self.description}: write failed: {err}") from None

    async def close(self) -> None:
        if self._db is not None:
            db, self._db = self._db, None
            await self._run(db.close)
        if self._lock_fd is not None:
            await self._run(self._unlock)
        self._pool.shutdown(wait=False)
