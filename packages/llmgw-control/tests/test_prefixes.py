"""The prefixes routers share (SharePrefixes, issue 26): the merge (examples and
hypothesis properties), the book's expiry and bounds, and the handler over real grpclib
sockets: a report's union comes back, bad reports are refused naming the field, and a
standby refuses with the leader's address."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpclib.client
import grpclib.const
import grpclib.server
import pytest
from grpclib.exceptions import GRPCError
from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_control.ca import init_ca, issue
from llmgw_control.leader_gate import LeaderGate
from llmgw_control.prefixes import (
    MAX_KEYS,
    PrefixBook,
    Prefixes,
    PrefixShare,
    bounded,
    from_wire,
    merge,
    report_problem,
    to_wire,
)
from llmgw_proto import v1
from llmgw_proto.tls import client_context
from llmgw_testkit import free_port

LEADER = "127.0.0.1:7171"

keys = st.dictionaries(
    st.integers(0, 2**64 - 1),
    st.tuples(st.integers(0, 1000), st.integers(0, 1000), st.sampled_from(["", "e0", "e1", "e2"])),
    max_size=8,
)
reports = st.lists(st.dictionaries(st.sampled_from(["", "a", "b"]), keys, max_size=3), max_size=5)


def test_merge_takes_the_smallest_known_size_sums_the_counts_and_the_most_named_holder() -> None:
    a: Prefixes = {"chat": {1: (8, 3, "e1"), 2: (4, 1, "e2"), 3: (0, 1, "")}}
    b: Prefixes = {"chat": {1: (12, 2, "e0"), 2: (0, 1, "e0")}, "code": {9: (4, 5, "")}}
    assert merge([a, b]) == {
        "chat": {1: (8, 5, "e1"), 2: (4, 2, "e0"), 3: (0, 1, "")},
        "code": {9: (4, 5, "")},
    }
    assert merge([]) == {}


@settings(deadline=None)
@given(reports)
def test_merge_is_the_union_whatever_the_order(rs: list[Prefixes]) -> None:
    out = merge(rs)
    assert out == merge(reversed(rs))
    for model in {m for r in rs for m in r}:
        seen = [r[model] for r in rs if model in r]
        assert set(out[model]) == {k for s in seen for k in s}
        for key, (size, count, holder) in out[model].items():
            known = [s[key][0] for s in seen if key in s and s[key][0]]
            assert size == (min(known) if known else 0)
            assert count == sum(s[key][1] for s in seen if key in s)
            tally: dict[str, int] = {}
            for s in seen:
                if key in s and s[key][2]:
                    tally[s[key][2]] = tally.get(s[key][2], 0) + max(1, s[key][1])
            assert holder == (min(tally, key=lambda h: (-tally[h], h)) if tally else "")
    # Merging the merged again with nothing changes nothing; a report merged with
    # itself doubles the counts only.
    assert merge([out]) == out
    twice = merge([out, out])
    assert {m: {k: (s, 2 * c, h) for k, (s, c, h) in ks.items()} for m, ks in out.items()} == twice


@settings(deadline=None)
@given(reports, st.integers(0, 20))
def test_bounded_keeps_the_largest_counts(rs: list[Prefixes], limit: int) -> None:
    full = merge(rs)
    out = bounded(full, limit)
    kept = [(m, k) for m, ks in out.items() for k in ks]
    total = sum(len(ks) for ks in full.values())
    assert len(kept) == min(limit, total)
    for m, k in kept:
        assert out[m][k] == full[m][k]
    if kept:
        floor = min(out[m][k][1] for m, k in kept)
        dropped = [full[m][k][1] for m, ks in full.items() for k in ks if k not in out.get(m, {})]
        assert all(c <= floor for c in dropped)


@settings(deadline=None)
@given(reports)
def test_the_wire_form_carries_every_key(rs: list[Prefixes]) -> None:
    union = merge(rs)
    wire = to_wire(union, 3)
    back = v1.PrefixSet.parse(bytes(wire))
    assert back.routers == 3
    report = v1.PrefixReport(router_id="r", models=back.models)
    assert from_wire(report) == {m: ks for m, ks in union.items() if ks}


def test_the_book_expires_reports_and_bounds_the_routers() -> None:
    book = PrefixBook(fresh=10.0, max_routers=2, recompute=0.0)
    book.report("ra", {"": {1: (8, 2, "e0")}}, at=0.0)
    book.report("rb", {"": {2: (4, 1, "")}}, at=5.0)
    assert book.union(6.0) == {"": {1: (8, 2, "e0"), 2: (4, 1, "")}}
    # ra's report is 10 s old at 10.0: gone.
    assert book.union(10.0) == {"": {2: (4, 1, "")}}
    assert len(book) == 1
    # A third router over max_routers: the least recently heard from goes.
    book.report("rc", {"": {3: (4, 1, "")}}, at=11.0)
    book.report("rb", {"": {2: (4, 1, "")}}, at=12.0)
    book.report("rd", {"": {4: (4, 1, "")}}, at=13.0)
    assert len(book) == 2
    assert set(book.union(13.0)[""]) == {2, 4}
    assert book.union(30.0) == {}


def test_the_union_is_computed_again_at_most_every_recompute_seconds() -> None:
    book = PrefixBook(recompute=1.0)
    book.report("ra", {"": {1: (8, 1, "")}}, at=0.0)
    assert book.union(0.0) == {"": {1: (8, 1, "")}}
    book.report("rb", {"": {2: (8, 1, "")}}, at=0.5)
    assert book.union(0.5) == {"": {1: (8, 1, "")}}
    assert book.union(1.0) == {"": {1: (8, 1, ""), 2: (8, 1, "")}}


@pytest.mark.parametrize(
    ("report", "named"),
    [
        (v1.PrefixReport(router_id=""), "router_id"),
        (v1.PrefixReport(router_id="r" * 254), "router_id"),
        (v1.PrefixReport(router_id="r", models=[v1.ModelPrefixes()] * 65), "models: at most 64"),
        (v1.PrefixReport(router_id="r", models=[v1.ModelPrefixes(model="m" * 1025)]), "models[0]"),
        (
            v1.PrefixReport(
                router_id="r",
                models=[v1.ModelPrefixes(keys=[v1.PrefixKey(key=i) for i in range(MAX_KEYS + 1)])],
            ),
            f"at most {MAX_KEYS} keys",
        ),
    ],
)
def test_bad_reports_are_named(report: v1.PrefixReport, named: str) -> None:
    problem = report_problem(report)
    assert problem is not None
    assert named in problem


async def _serve(
    services: list[Any],
) -> tuple[grpclib.server.Server, grpclib.client.Channel]:
    server = grpclib.server.Server(services)
    port = free_port()
    await server.start("127.0.0.1", port)
    return server, grpclib.client.Channel("127.0.0.1", port)


def _report(router_id: str, *keys: tuple[int, int, int, str]) -> v1.PrefixReport:
    return v1.PrefixReport(
        router_id=router_id,
        models=[
            v1.ModelPrefixes(
                model="",
                keys=[v1.PrefixKey(key=k, size=s, count=c, holder=h) for k, s, c, h in keys],
            )
        ],
    )


async def test_two_routers_reports_come_back_merged_over_grpc() -> None:
    share = PrefixShare(book=PrefixBook(recompute=0.0))
    server, channel = await _serve([share])
    try:
        stub = v1.EndpointServiceStub(channel)
        first = await stub.share_prefixes(_report("ra", (2**64 - 1, 8, 3, "e1"), (7, 4, 1, "e1")))
        assert first.routers == 1
        second = await stub.share_prefixes(_report("rb", (7, 12, 2, "e2"), (9, 4, 1, "")))
        assert second.routers == 2
        got = {k.key: (k.size, k.count, k.holder) for m in second.models for k in m.keys}
        assert got == {2**64 - 1: (8, 3, "e1"), 7: (4, 3, "e2"), 9: (4, 1, "")}
        with pytest.raises(GRPCError) as err:
            await stub.share_prefixes(v1.PrefixReport(router_id=""))
        assert err.value.status == grpclib.const.Status.INVALID_ARGUMENT
        assert "router_id" in str(err.value.message)
    finally:
        channel.close()
        server.close()
        await server.wait_closed()


async def test_a_standby_refuses_with_the_leaders_address() -> None:
    share = PrefixShare()
    server, channel = await _serve([LeaderGate([share], lambda: False, lambda: LEADER)])
    try:
        with pytest.raises(GRPCError) as err:
            await v1.EndpointServiceStub(channel).share_prefixes(_report("ra", (1, 4, 1, "")))
        assert err.value.status == grpclib.const.Status.UNAVAILABLE
        assert f"the leader is {LEADER}" in str(err.value.message)
        assert len(share.book) == 0
    finally:
        channel.close()
        server.close()
        await server.wait_closed()


async def test_over_mtls_only_a_router_certificate_may_share(
    tmp_path: Path, control_factory: Callable[..., Any]
) -> None:
    """A real `llmgw-control serve` process: SharePrefixes is served (wired beside the
    other router calls) and checked as they are: a router's certificate gets the union,
    a node's is refused with PERMISSION_DENIED."""
    ca = init_ca(tmp_path / "ca")
    server = issue(tmp_path / "ca", "server", "control", hosts=["127.0.0.1"], out=tmp_path / "s")
    tls = {"cert": str(server.cert), "key": str(server.key), "ca": str(ca.cert)}
    model = {"name": "m", "profiles": {"p": {"engine": "vllm", "gpus_per_node": 1}}}
    control = control_factory([model], tls=tls)

    async def share(role: str, name: str) -> v1.PrefixSet:
        who = issue(tmp_path / "ca", role, name, out=tmp_path / name)
        ctx = client_context(who.cert, who.key, ca.cert)
        channel = grpclib.client.Channel("127.0.0.1", control.grpc_port, ssl=ctx)
        try:
            return await v1.EndpointServiceStub(channel).share_prefixes(
                _report(name, (5, 8, 2, "e0")), timeout=30
            )
        finally:
            channel.close()

    got = await share("router", "edge-1")
    assert [(k.key, k.size, k.count, k.holder) for m in got.models for k in m.keys] == [
        (5, 8, 2, "e0")
    ]
    with pytest.raises(GRPCError) as err:
        await share("node", "gpu-a")
    assert err.value.status == grpclib.const.Status.PERMISSION_DENIED
    assert "only a router certificate" in str(err.value.message)
