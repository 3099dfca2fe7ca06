"""Leadership against the real thing: a real etcd, a real PostgreSQL, and a backend
whose renewals fail or hang.

One instance leads; cut off from its store it steps down within its lease and another
leads with a newer epoch, and the deposed one's writes are fenced. Renewals run on a
thread of their own: a held main loop neither loses the lease nor dispatches past it.
A standby refuses calls with the leader's address.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from llmgw_control.config import EtcdSettings, HaSettings, PostgresSettings
from llmgw_control.leadership import Leadership
from llmgw_control.store.base import Change, NotLeader
from llmgw_control.store.etcd import EtcdBackend, EtcdStore
from llmgw_control.store.postgres import PostgresBackend, PostgresStore
from llmgw_proto import v1
from llmgw_testkit import free_port, wait_for_async
from llmgw_testkit.servers import Etcd, Postgres

# The etcd and PostgreSQL servers (once per module) are conftest's fixtures.

_prefixes = iter(range(10**6))


def etcd_settings(etcd: Etcd, **extra: Any) -> EtcdSettings:
    return EtcdSettings(endpoints=[etcd.endpoint], prefix=f"/t{next(_prefixes)}", **extra)


# --- leadership and fencing ---------------------------------------------------------


def ha(ttl: float = 2.0) -> HaSettings:
    return HaSettings(backend="etcd", lease_ttl=ttl)  # type: ignore[arg-type]


class Watcher:
    def __init__(self) -> None:
        self.elected: list[int] = []
        self.lost: list[str] = []

    async def on_elected(self, epoch: int) -> None:
        self.elected.append(epoch)

    def on_lost(self, why: str) -> None:
        self.lost.append(why)


async def leaders(make_backend: Any, ttl: float = 2.0) -> None:
    """Two instances: one leads; when it is cut off, it steps down and the other leads."""
    a_store, a_backend = await make_backend("a")
    b_store, b_backend = await make_backend("b")
    wa, wb = Watcher(), Watcher()
    a = Leadership(a_backend, ha(ttl), "a", "127.0.0.1:1", wa.on_elected, wa.on_lost, poll=0.1)
    task_a = asyncio.create_task(a.run())
    await wait_for_async(_async(lambda: a.leading), timeout=20, what="a leads")
    b = Leadership(b_backend, ha(ttl), "b", "127.0.0.1:2", wb.on_elected, wb.on_lost, poll=0.1)
    task_b = asyncio.create_task(b.run())
    try:
        await wait_for_async(
            _async(lambda: b.leader_address == "127.0.0.1:1"), timeout=20, what="b knows a leads"
        )
        assert not b.leading
        await a_store.write([Change("node", "n", b"from a")])
        # a loses its hold on the store (its lease or session ends under it).
        await cut(a_store)
        await wait_for_async(_async(lambda: wa.lost), timeout=20, what="a steps down")
        assert not a.leading
        await wait_for_async(_async(lambda: b.leading), timeout=30, what="b leads")
        assert wb.elected[0] > wa.elected[0], "a new leader has a newer epoch"
        with pytest.raises(NotLeader):
            await a_store.write([Change("node", "n", b"from deposed a")])
        await b_store.write([Change("node", "n", b"from b")])
        assert (await b_store.load())["node"]["n"] == b"from b"
    finally:
        for t in (task_a, task_b):
            t.cancel()
        await asyncio.gather(task_a, task_b, return_exceptions=True)
        await a_store.close()
        await b_store.close()


def _async(fn: Any) -> Any:
    async def probe() -> Any:
        return fn()

    return probe


async def cut(store: Any) -> None:
    if isinstance(store, EtcdStore):
        # The lease goes, and the leader key with it.
        await store.client.revoke_lease(store.fence and _lease_of(store))
    else:
        other = await store.connect()
        await other.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory'"
            " AND pid <> pg_backend_pid()"
        )
        await other.close()


def _lease_of(store: EtcdStore) -> int:
    import json

    assert store.fence is not None
    return int(json.loads(store.fence[1])["lease"])


async def test_etcd_one_leader_fenced_writes_and_takeover(etcd: Etcd) -> None:
    s = etcd_settings(etcd)

    async def make(name: str) -> Any:
        store = EtcdStore(s)
        await store.open()
        return store, EtcdBackend(store, name, {"a": "127.0.0.1:1", "b": "127.0.0.1:2"}[name], 2)

    await leaders(make)


async def test_postgres_one_leader_fenced_writes_and_takeover(postgres: Postgres) -> None:
    async def make(name: str) -> Any:
        store = PostgresStore(PostgresSettings(dsn=postgres.dsn))
        await store.open()
        return store, PostgresBackend(store, name, {"a": "127.0.0.1:1", "b": "127.0.0.1:2"}[name])

    await leaders(make)


class FakeBackend:
    """A leadership backend whose renewals can be made to fail or hang."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.released = 0

    async def acquire(self) -> int | None:
        # Someone else holds the lead once this one's renewals broke.
        return 7 if self.mode == "ok" else None

    async def renew(self) -> bool:
        if self.mode == "hang":
            await asyncio.sleep(3600)
        return self.mode == "ok"

    async def leader(self) -> tuple[str, str] | None:
        return None

    async def release(self) -> None:
        self.released += 1


@pytest.mark.parametrize("mode", ["refused", "hang"])
async def test_a_leader_steps_down_within_its_lease(mode: str) -> None:
    backend = FakeBackend()
    w = Watcher()
    lead = Leadership(backend, ha(1.0), "a", "127.0.0.1:1", w.on_elected, w.on_lost, poll=0.05)
    task = asyncio.create_task(lead.run())
    try:
        await wait_for_async(_async(lambda: w.elected == [7]), what="elected")
        await asyncio.sleep(0.8)  # a few good renewals
        assert lead.leading
        backend.mode = mode
        await wait_for_async(_async(lambda: w.lost), timeout=10, what="stepped down")
        # A hanging renewal is given up at the lease's end, not waited for.
        assert ("no renewal within the lease" in w.lost[0]) == (mode == "hang")
        assert [lead.leading] == [False]  # (a list: mypy narrowed it above)
        # The lease is released on the renewal thread, which may come after on_lost.
        await wait_for_async(
            _async(lambda: backend.released >= 1), timeout=10, what="the lease released"
        )
    finally:
        task.cancel()


@pytest.mark.parametrize("leader", ["", "127.0.0.1:7171"])
async def test_a_standby_refuses_with_the_leaders_address(leader: str) -> None:
    import grpclib.client
    import grpclib.const
    import grpclib.server
    from grpclib.exceptions import GRPCError
    from llmgw_control.leader_gate import LEADER_METADATA, LeaderGate
    from llmgw_control.publish import Publisher

    gate = LeaderGate([Publisher()], lambda: False, lambda: leader)
    server = grpclib.server.Server([gate])
    port = free_port()
    await server.start("127.0.0.1", port)
    channel = grpclib.client.Channel("127.0.0.1", port)
    try:
        async with channel.request(
            "/llmgw.v1.EndpointService/Watch",
            grpclib.const.Cardinality.UNARY_STREAM,
            v1.WatchRequest,
            v1.EndpointSnapshot,
        ) as stream:
            await stream.send_message(v1.WatchRequest(router_id="r"), end=True)
            with pytest.raises(GRPCError) as err:
                await stream.recv_message()
            assert err.value.status == grpclib.const.Status.UNAVAILABLE
            trailers = dict(stream.trailing_metadata or {})
            assert trailers.get(LEADER_METADATA) == (leader or None)
            assert ("the leader is " + leader if leader else "no leader known") in str(
                err.value.message
            )
    finally:
        channel.close()
        server.close()
        await server.wait_closed()


# --- renewals on their own thread ---------------------------------------------------


def busy(seconds: float) -> None:
    """Hold the calling thread (the main loop) with Python work, as a saturated loop does."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(2000))


@pytest.mark.parametrize("kind", ["etcd", "postgres"])
async def test_a_busy_main_loop_does_not_lose_the_lease(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """The main loop held for 2.5 lease TTLs: a keeps leading, b never takes over."""
    ttl = 2.0
    server = request.getfixturevalue(kind)
    s = etcd_settings(server) if kind == "etcd" else None

    async def make(name: str) -> Any:
        address = {"a": "127.0.0.1:1", "b": "127.0.0.1:2"}[name]
        if s is not None:
            store: Any = EtcdStore(s)
            await store.open()
            return store, EtcdBackend(store, name, address, ttl)
        store = PostgresStore(PostgresSettings(dsn=server.dsn))
        await store.open()
        return store, PostgresBackend(store, name, address)

    a_store, a_backend = await make("a")
    b_store, b_backend = await make("b")
    wa, wb = Watcher(), Watcher()
    a = Leadership(a_backend, ha(ttl), "a", "127.0.0.1:1", wa.on_elected, wa.on_lost, poll=0.1)
    b = Leadership(b_backend, ha(ttl), "b", "127.0.0.1:2", wb.on_elected, wb.on_lost, poll=0.1)
    task_a = asyncio.create_task(a.run())
    task_b: asyncio.Task[None] | None = None
    try:
        await wait_for_async(_async(lambda: wa.elected), timeout=20, what="a elected")
        task_b = asyncio.create_task(b.run())
        await wait_for_async(
            _async(lambda: b.leader_address == "127.0.0.1:1"), timeout=20, what="b knows a leads"
        )
        renewed = a.renewals
        busy(2.5 * ttl)  # no await: the main loop runs nothing else meanwhile
        assert a.renewals > renewed, "a's renewals went on while its main loop was held"
        assert a.valid()
        assert a.leading
        assert not b.leading
        await asyncio.sleep(0.5)  # whatever the held loop queued runs now
        assert wa.lost == []
        assert wb.elected == []
        # The store agrees: a's fenced write goes through, b's is refused.
        await a_store.write([Change("node", "n", b"from a")])
        with pytest.raises(NotLeader):
            await b_store.write([Change("node", "n", b"from b")])
    finally:
        tasks = [t for t in (task_a, task_b) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await a_store.close()
        await b_store.close()


class Stub:
    """AgentEvents that ignore everything: only AgentService.send is under test here."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


@pytest.mark.parametrize("mode", ["refused", "hang"])
async def test_a_lost_lease_stops_dispatch_while_the_main_loop_is_held(mode: str) -> None:
    """The renewals fail while the main loop is busy: dispatch stops within the lease,
    without the main loop's help, and on_lost runs once it is free again."""
    from llmgw_control.agent_service import AgentService, Session

    ttl = 1.0
    backend = FakeBackend()
    w = Watcher()
    lead = Leadership(backend, ha(ttl), "a", "127.0.0.1:1", w.on_elected, w.on_lost, poll=0.05)
    agents = AgentService(Stub(), heartbeat_interval=1.0, command_timeout=30.0)
    agents.lease_valid = lead.valid
    agents.sessions["n"] = Session("n", "s", "127.0.0.1")
    command = v1.ControlMessage(stop_shard=v1.StopShard(command_id="c", shard_id="x"))
    task = asyncio.create_task(lead.run())
    try:
        await wait_for_async(_async(lambda: w.elected == [7]), what="elected")
        await wait_for_async(_async(lambda: lead.renewals >= 2), what="renewing")
        assert agents.send("n", "c0", command), "a valid lease dispatches"
        backend.mode = mode
        # Held from here on; sample until dispatch stops (or a generous deadline).
        deadline = time.monotonic() + 20 * ttl
        late: list[float] = []
        while time.monotonic() < deadline:
            ok, until = agents.send("n", "c1", command), lead.valid_until
            now = time.monotonic()
            if ok and until and now > until:
                late.append(now - until)
            if not ok:
                break
            busy(0.01)
        else:
            raise AssertionError("dispatch never stopped while the main loop was held")
        assert late == [], "nothing is dispatched past the lease's end"
        assert not lead.valid()
        # The renewal thread marks the lead lost (a hanging renewal: at the lease's end).
        deadline = time.monotonic() + 10 * ttl
        while lead.leading and time.monotonic() < deadline:
            busy(0.01)
        assert [lead.leading] == [False]
        assert w.lost == [], "on_lost waits for the main loop; dispatch did not"
        await wait_for_async(_async(lambda: w.lost), timeout=10, what="on_lost on the main loop")
        assert ("no renewal within the lease" in w.lost[0]) == (mode == "hang")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
