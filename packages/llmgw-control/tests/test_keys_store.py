"""Keys, usage, sequences and grants through each real store: SQLite, etcd, PostgreSQL.

What one control plane counted and stored, the next (a restart, or a new leader on a
shared store) reads back: the same keys, the same budget use, a retried report not
counted again, the grants routers hold still held.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path

from llmgw_control.config import EtcdSettings, PostgresSettings
from llmgw_control.store.base import Store
from llmgw_control.store.etcd import EtcdStore
from llmgw_control.store.keeper import StateKeeper
from llmgw_control.store.postgres import PostgresStore
from llmgw_control.store.sqlite import SqliteStore
from llmgw_control.tenants import Tenants
from llmgw_proto import v1
from llmgw_testkit.servers import Etcd, Postgres

NOW = dt.datetime(2026, 12, 2, 12, 0, tzinfo=dt.UTC).timestamp()


async def open_tenants(store: Store) -> Tenants:
    keeper = StateKeeper(store)
    await store.open()
    keeper.restored(await keeper.load(), 0)
    t = Tenants(keeper=lambda: keeper, clock=lambda: NOW)
    t.restore(keeper)
    return t


def usage_report(router: str, seq: int, tokens: int) -> v1.UsageReport:
    return v1.UsageReport(
        router_id=router,
        instance=f"{router}-1",
        sequence=seq,
        usage=[v1.KeyUsage(key="k", requests=1, prompt_tokens=tokens, demand_tpm=10.0)],
    )


def budget_share(reply: v1.UsageReply) -> v1.KeyShare:
    return next(s for s in reply.shares if s.key == "k")


async def kept_across_opens(make: Callable[[], Store]) -> None:
    store = make()
    first = await open_tenants(store)
    record, _ = first.create("k", {"budget_tokens": 1000, "budget_period": "day", "rpm": 5})
    first.report(usage_report("a", 1, 100))
    granted = budget_share(first.report(usage_report("a", 2, 50))).budget_tokens
    assert await first.stored(10.0)
    await store.close()

    again = make()
    second = await open_tenants(again)
    try:
        assert second.keys == {"k": record}
        assert second.period_used(second.keys["k"], NOW) == 150
        # Router a's report 2 again (its reply was lost): not counted twice.
        assert budget_share(second.report(usage_report("a", 2, 50))).budget_used == 150
        # Router b gets no part of what a still holds.
        b = budget_share(second.report(usage_report("b", 1, 0))).budget_tokens
        assert 0 < b <= 1000 - 150 - granted
    finally:
        await again.close()


async def test_sqlite(tmp_path: Path) -> None:
    await kept_across_opens(lambda: SqliteStore(tmp_path / "state"))


async def test_etcd(etcd: Etcd) -> None:
    settings = EtcdSettings(endpoints=[etcd.endpoint], prefix="/keys-test")
    await kept_across_opens(lambda: EtcdStore(settings))


async def test_postgres(postgres: Postgres) -> None:
    settings = PostgresSettings(dsn=postgres.dsn)
    try:
        await kept_across_opens(lambda: PostgresStore(settings))
    finally:
        store = PostgresStore(settings)
        await store.open()
        await store.conn.execute("DELETE FROM llmgw_records")
        await store.close()
