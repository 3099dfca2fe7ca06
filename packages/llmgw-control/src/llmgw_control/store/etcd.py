"""etcd (v3 API, through the asyncio client ``aetcd``): records under one key prefix.

``{prefix}/schema`` holds the schema version, ``{prefix}/records/{kind}/{key}`` each
record, and ``{prefix}/leader`` the leader's claim (:class:`EtcdBackend`, for :mod:`llmgw_control.leadership`).
With a leader, every write is one transaction that first compares the leader key's
value with this instance's claim: a deposed leader cannot write.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from collections.abc import Sequence
from typing import Any

import aetcd  # type: ignore[import-untyped]
import aetcd.exceptions  # type: ignore[import-untyped]

from llmgw_control.config import EtcdSettings, split_hostport
from llmgw_control.store.base import (
    SCHEMA_VERSION,
    Change,
    NotLeader,
    Records,
    StoreError,
    check_schema,
    group,
)

__all__ = ["EtcdBackend", "EtcdStore"]

# etcd refuses transactions of more than 128 operations by default.
TXN_OPS = 100
# ... and requests over 1.5 MiB (--max-request-bytes): a transaction's keys and values
# stay under TXN_BYTES, and a record over PART_BYTES (the published endpoints of 10,000
# replicas are about 1.7 MB) is written in parts under {prefix}/parts/{kind}/{key}/{gen}/,
# the record itself a marker naming the generation and the count of parts.
TXN_BYTES = 1 << 20
PART_BYTES = 512 << 10
MARKER = b"\x00llmgw-parts:"


class EtcdStore:
    def __init__(self, settings: EtcdSettings, setting: str = "state.etcd.endpoints") -> None:
        self.settings = settings
        self.setting = setting
        self.prefix = settings.prefix.rstrip("/")
        self.description = f"etcd store {', '.join(settings.endpoints)} ({setting})"
        self.client: Any = None
        # The leader claim every write is fenced on (set while this instance leads).
        self.fence: tuple[bytes, bytes] | None = None
        # With HA, a write without a claim (a standby, a deposed leader) is refused.
        self.ha = False
        # Records written in parts, whose parts go when they are rewritten small or deleted.
        self._parted: set[tuple[str, str]] = set()

    def key(self, *parts: str) -> bytes:
        return "/".join((self.prefix, *parts)).encode()

    def _record_key(self, kind: str, key: str) -> bytes:
        return self.key("records", kind, key)

    async def open(self) -> None:
        problems = []
        timeout = max(int(self.settings.timeout), 1)
        for endpoint in self.settings.endpoints:
            host, port = split_hostport(endpoint.split("://", 1)[-1])
            client = aetcd.Client(
                host=host,
                port=port,
                username=self.settings.username or None,
                password=self.settings.password or None,
                timeout=timeout,
                # A whole fleet's records in one range answer can pass gRPC's 4 MiB default.
                options={"grpc.max_receive_message_length": 1 << 30},
            )
            try:
                await client.connect()
                found = await client.get(self.key("schema"))
            except aetcd.exceptions.UnauthenticatedError as err:
                await _close(client)
                raise StoreError(
                    f"{self.description}: etcd refused the credentials "
                    f"(state.etcd.username/password): {_why(err)}"
                ) from None
            except (aetcd.exceptions.ClientError, OSError) as err:
                await _close(client)
                problems.append(f"{endpoint}: {_why(err)}")
                continue
            self.client = client
            break
        else:
            raise StoreError(f"{self.description}: etcd cannot be reached: {'; '.join(problems)}")
        version = int(found.value) if found is not None else None
        check_schema(self.description, version, self.setting)
        if version is None:
            await self._call(self.client.put(self.key("schema"), str(SCHEMA_VERSION).encode()))

    async def _call(self, coro: Any) -> Any:
        try:
            return await coro
        except (aetcd.exceptions.ClientError, OSError) as err:
            raise StoreError(f"{self.description}: {_why(err)}") from None

    def _parts_key(self, kind: str, key: str, gen: str = "") -> bytes:
        return self.key("parts", kind, key, gen) if gen else self.key("parts", kind, key) + b"/"

    async def load(self) -> Records:
        base = self.key("records") + b"/"
        got = await self._call(self.client.get_prefix(base))
        out: Records = {}
        for kv in got:
            rest = bytes(kv.key)[len(base) :].decode()
            kind, _, key = rest.partition("/")
            value = bytes(kv.value)
            if value.startswith(MARKER):
                value = await self._joined(kind, key, value)
                self._parted.add((kind, key))
            out.setdefault(kind, {})[key] = value
        return out

    async def _joined(self, kind: str, key: str, marker: bytes) -> bytes:
        gen, _, count = marker[len(MARKER) :].decode().partition(":")
        prefix = self._parts_key(kind, key, gen) + b"/"
        got = await self._call(self.client.get_prefix(prefix))
        parts = {int(bytes(kv.key)[len(prefix) :]): bytes(kv.value) for kv in got}
        if sorted(parts) != list(range(int(count))):
            raise StoreError(
                f"{self.description}: record {kind}/{key} is missing parts "
                f"(has {len(parts)} of {count})"
            )
        return b"".join(parts[i] for i in range(int(count)))

    async def write(self, changes: Sequence[Change]) -> None:
        t = self.client.transactions
        batches: list[list[Any]] = [[]]
        size = 0
        parted: list[tuple[str, str, str]] = []
        for (kind, key), value in group(changes).items():
            rk = self._record_key(kind, key)
            if value is not None and len(value) > PART_BYTES:
                gen = secrets.token_hex(4)
                count = 0
                for i in range(0, len(value), PART_BYTES):
                    part = self._parts_key(kind, key, gen) + f"/{count}".encode()
                    await self.txn([t.put(part, value[i : i + PART_BYTES])])
                    count += 1
                value = MARKER + f"{gen}:{count}".encode()
                parted.append((kind, key, gen))
            elif (kind, key) in self._parted:
                parted.append((kind, key, ""))
            op = t.delete(rk) if value is None else t.put(rk, value)
            cost = len(rk) + (len(value) if value is not None else 0)
            if len(batches[-1]) >= TXN_OPS or (batches[-1] and size + cost > TXN_BYTES):
                batches.append([])
                size = 0
            batches[-1].append(op)
            size += cost
        for ops in batches:
            if ops:
                await self.txn(ops)
        for kind, key, gen in parted:
            await self._drop_parts(kind, key, keep=gen)

    async def _drop_parts(self, kind: str, key: str, keep: str) -> None:
        """Parts of other generations than ``keep`` ("" = all) are deleted."""
        t = self.client.transactions
        prefix = self._parts_key(kind, key)
        got = await self._call(self.client.get_prefix(prefix, keys_only=True))
        old = [bytes(kv.key) for kv in got]
        if keep:
            old = [k for k in old if not k.startswith(prefix + keep.encode() + b"/")]
        for i in range(0, len(old), TXN_OPS):
            await self.txn([t.delete(k) for k in old[i : i + TXN_OPS]])
        if keep:
            self._parted.add((kind, key))
        else:
            self._parted.discard((kind, key))

    async def txn(self, ops: list[Any]) -> None:
        t = self.client.transactions
        compare = []
        if self.ha and self.fence is None:
            raise NotLeader(f"{self.description}: this instance does not lead")
        if self.fence is not None:
            leader_key, claim = self.fence
            compare = [t.value(leader_key) == claim]
        ok, _ = await self._call(self.client.transaction(compare=compare, success=ops, failure=[]))
        if not ok:
            raise NotLeader(f"{self.description}: the leader key no longer holds this instance")

    async def close(self) -> None:
        if self.client is not None:
            await _close(self.client)
            self.client = None


async def _close(client: Any) -> None:
    # Closing a broken channel may fail any way.
    with contextlib.suppress(Exception):
        await client.close()


def _why(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class EtcdBackend:
    """Leadership on etcd: the lease and the leader key, through a client of its own.

    A :class:`llmgw_control.leadership.Backend`: every method runs on the renewal
    thread's loop.

    The store's client (on the main loop) writes the records, each write fenced on
    the claim this backend puts in ``store.fence``.
    """

    def __init__(self, store: EtcdStore, instance: str, address: str, ttl: float) -> None:
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
