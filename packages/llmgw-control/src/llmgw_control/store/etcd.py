"""etcd (v3 API, through the asyncio client ``aetcd``): records under one key prefix.

``{prefix}/schema`` holds the schema version, ``{prefix}/records/{kind}/{key}`` each
record, and ``{prefix}/leader`` the leader's claim (see :mod:`llmgw_control.ha`).
With a leader, every write is one transaction that first compares the leader key's
value with this instance's claim: a deposed leader cannot write.
"""

from __future__ import annotations

import contextlib
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

__all__ = ["EtcdStore"]

# etcd refuses transactions of more than 128 operations by default.
TXN_OPS = 100


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

    async def load(self) -> Records:
        base = self.key("records") + b"/"
        got = await self._call(self.client.get_prefix(base))
        out: Records = {}
        for kv in got:
            rest = bytes(kv.key)[len(base) :].decode()
            kind, _, key = rest.partition("/")
            out.setdefault(kind, {})[key] = bytes(kv.value)
        return out

    async def write(self, changes: Sequence[Change]) -> None:
        t = self.client.transactions
        ops: list[Any] = []
        for (kind, key), value in group(changes).items():
            rk = self._record_key(kind, key)
            ops.append(t.delete(rk) if value is None else t.put(rk, value))
        for i in range(0, len(ops), TXN_OPS):
            await self.txn(ops[i : i + TXN_OPS])

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
