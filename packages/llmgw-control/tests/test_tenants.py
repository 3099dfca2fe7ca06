"""Keys, usage and shares held in memory (no sockets): counted once, restored, bounded."""

from __future__ import annotations

import datetime as dt

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_control.keys import KeyInputError
from llmgw_control.store.keeper import StateKeeper
from llmgw_control.tenants import KeyConflict, Tenants
from llmgw_control.usage import UsageBook, parse_since
from llmgw_proto import v1

NOW = dt.datetime(2026, 12, 2, 12, 0, tzinfo=dt.UTC).timestamp()


class Clock:
    def __init__(self, at: float = NOW) -> None:
        self.at = at

    def __call__(self) -> float:
        return self.at


def tenants(keeper: StateKeeper | None = None, clock: Clock | None = None) -> Tenants:
    k = keeper or StateKeeper()
    t = Tenants(keeper=lambda: k, clock=clock or Clock())
    t.restore(k)
    return t


def report(
    router: str, seq: int, instance: str = "", **usage: dict[str, float | int]
) -> v1.UsageReport:
    return v1.UsageReport(
        router_id=router,
        instance=instance or f"{router}-1",
        sequence=seq,
        usage=[v1.KeyUsage(key=k, **fields) for k, fields in usage.items()],  # type: ignore[arg-type]
    )


def share(reply: v1.UsageReply, key: str) -> v1.KeyShare:
    return next(s for s in reply.shares if s.key == key)


def test_create_update_revoke_and_the_key_set() -> None:
    t = tenants()
    v0 = t.version
    record, secret = t.create("team-a", {"rpm": "60", "models": "m1,m2"})
    assert secret.startswith(record.prefix + "_")
    assert t.version > v0
    with pytest.raises(KeyConflict, match="a key named 'team-a' exists"):
        t.create("team-a", {})
    with pytest.raises(KeyInputError, match="--tpm: expected a whole number"):
        t.update("team-a", {"tpm": "x"})
    with pytest.raises(KeyInputError, match="nothing to change"):
        t.update("team-a", {})
    with pytest.raises(KeyConflict, match="no key named 'nope'"):
        t.revoke("nope")
    t.update("team-a", {"tpm": 1000})
    v1_ = t.version
    t.revoke("team-a")
    assert t.version > v1_
    sent = t.key_set()
    assert [(k.name, k.rpm, k.tpm, k.revoked, list(k.models)) for k in sent.keys] == [
        ("team-a", 60, 1000, True, ["m1", "m2"])
    ]
    assert secret not in str(sent)
    with pytest.raises(KeyConflict, match="is revoked"):
        t.update("team-a", {"rpm": 1})


def test_a_report_is_counted_once_and_survives_a_restart() -> None:
    keeper = StateKeeper()
    clock = Clock()
    t = tenants(keeper, clock)
    t.create("k", {"budget_tokens": 1000, "budget_period": "day"})
    u = {"requests": 2, "prompt_tokens": 30, "completion_tokens": 70, "demand_tpm": 50.0}
    first = t.report(report("r1", 1, k=u))
    assert share(first, "k").budget_used == 100
    again = t.report(report("r1", 1, k=u))  # retried: the same sequence
    assert share(again, "k").budget_used == 100
    t.report(report("r1", 2, k=u))
    assert t.period_used(t.keys["k"], clock()) == 200
    # A restart: a new process reads the records back.
    back = tenants(keeper, clock)
    assert back.period_used(back.keys["k"], clock()) == 200
    assert share(back.report(report("r1", 2, k=u)), "k").budget_used == 200
    assert share(back.report(report("r1", 3, k=u)), "k").budget_used == 300
    # A restarted router starts a new sequence under a new instance.
    assert share(back.report(report("r1", 1, instance="r1-2", k=u)), "k").budget_used == 400
    listed = back.listing()[0]
    assert listed["usage"]["requests"] == 8
    assert listed["budget_used"] == 400
    assert listed["last_used"] == "2026-12-02T12:00:00+00:00"


def test_budget_resets_with_its_period() -> None:
    clock = Clock()
    t = tenants(clock=clock)
    t.create("k", {"budget_tokens": 1000, "budget_period": "day"})
    t.report(report("r1", 1, k={"prompt_tokens": 900}))
    assert share(t.report(report("r1", 2)), "k").budget_tokens <= 100
    clock.at += 86400
    assert share(t.report(report("r1", 3)), "k").budget_used == 0
    assert share(t.report(report("r1", 4)), "k").budget_tokens > 900


def test_keys_unknown_here_are_not_counted() -> None:
    t = tenants()
    reply = t.report(report("r1", 1, other={"requests": 5}))
    assert reply.shares == []
    assert t.book.hours == {}


def test_rate_shares_follow_demand_across_two_routers() -> None:
    t = tenants()
    t.create("k", {"rpm": 100, "max_concurrent": 10})
    t.report(report("a", 1, k={"demand_rpm": 900.0}))
    # b came second: a held the whole limit, so b gets what a gives back at its next
    # report; the shares held never sum above the limit meanwhile.
    b = share(t.report(report("b", 1, k={"demand_rpm": 100.0})), "k")
    assert b.rpm < 1
    a = share(t.report(report("a", 2, k={"demand_rpm": 900.0})), "k")
    assert a.rpm + b.rpm <= 100
    b = share(t.report(report("b", 2, k={"demand_rpm": 100.0})), "k")
    assert a.rpm + b.rpm <= 100
    assert a.rpm > 4 * b.rpm > 0
    assert a.max_concurrent + b.max_concurrent == 10
    assert b.max_concurrent >= 1
    assert t.report(report("a", 3)).valid_for == dt.timedelta(seconds=10)


def test_bad_reports_are_named() -> None:
    from llmgw_control.tenants import report_problem

    assert report_problem(v1.UsageReport(instance="i")) == "router_id: 1 to 256 characters, got 0"
    assert "instance" in str(report_problem(v1.UsageReport(router_id="r")))
    assert report_problem(v1.UsageReport(router_id="r", instance="i")) is None


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 100_000),
    st.lists(
        st.tuples(st.sampled_from(["a", "b", "c"]), st.floats(0, 1), st.floats(0, 1e5)),
        max_size=60,
    ),
)
def test_the_fleet_never_overruns_a_budget(
    budget: int, steps: list[tuple[str, float, float]]
) -> None:
    """Routers use any part of their grants, report in any order, and retry: what the
    store counted plus every grant outstanding stays within the budget."""
    clock = Clock()
    t = tenants(clock=clock)
    t.create("k", {"budget_tokens": budget, "budget_period": "month"})
    held = {"a": 0, "b": 0, "c": 0}
    seq = {"a": 0, "b": 0, "c": 0}
    for router, part, want in steps:
        used = int(held[router] * part)
        seq[router] += 1
        got = share(
            t.report(report(router, seq[router], k={"prompt_tokens": used, "demand_tpm": want})),
            "k",
        )
        held[router] = got.budget_tokens
        counted = t.period_used(t.keys["k"], clock())
        assert counted + sum(held.values()) <= budget
        clock.at += 0.5


def test_usage_book_prunes_old_hours() -> None:
    book = UsageBook()
    from llmgw_control.usage import Counts

    book.add("i", 1, [("k", Counts(requests=1, prompt_tokens=5))], NOW)
    assert book.prune(NOW + 41 * 86400)[0][0] == "keyusage"
    assert book.hours == {"k": {}}


@pytest.mark.parametrize(
    ("text", "seconds"), [("30m", 1800), ("2h", 7200), ("7d", 604800), ("1d12h", 129600)]
)
def test_since(text: str, seconds: float) -> None:
    assert parse_since(text) == seconds


@pytest.mark.parametrize("text", ["", "0h", "2x", "h", "-1h", "1h 2"])
def test_bad_since_names_the_flag(text: str) -> None:
    with pytest.raises(ValueError, match="--since: expected a duration"):
        parse_since(text)


@given(st.text(max_size=12))
def test_any_since_is_parsed_or_refused(text: str) -> None:
    try:
        seconds = parse_since(text)
    except ValueError as err:
        assert str(err).startswith("--since:")  # noqa: PT017 - any text, either way
        return
    assert seconds > 0


def test_a_silent_routers_grant_is_held_then_released_and_survives_a_restart() -> None:
    keeper = StateKeeper()
    clock = Clock()
    t = tenants(keeper, clock)
    t.create("k", {"budget_tokens": 1000, "budget_period": "day"})
    a = share(t.report(report("a", 1, k={"demand_tpm": 100.0})), "k").budget_tokens
    assert a > 0
    # Router a falls silent (cut off: it keeps its grant); b never gets a's part ...
    clock.at += 60
    back = tenants(keeper, clock)  # ... not even from a restarted control plane.
    b = share(back.report(report("b", 1, k={"demand_tpm": 100.0})), "k").budget_tokens
    assert a + b <= 1000
    assert b <= 1000 - a
    # Once a's grant is past GRANT_HOLD it is given back.
    clock.at += 600
    b = share(back.report(report("b", 2, k={"demand_tpm": 100.0})), "k").budget_tokens
    assert b > 1000 - a


def test_shares_of_routers_gone_silent_are_forgotten() -> None:
    clock = Clock()
    t = tenants(clock=clock)
    t.create("k", {"rpm": 100})
    t.report(report("a", 1, k={"demand_rpm": 50.0}))
    clock.at += 120  # a is gone; its share expired long ago
    b = share(t.report(report("b", 1, k={"demand_rpm": 50.0})), "k")
    assert b.rpm > 99
    assert set(t.held[("k", "rpm")]) == {"b"}
    assert "a" not in t.routers
    t.revoke("k")
    clock.at += 120
    t.report(report("b", 2))
    assert t.held == {}
