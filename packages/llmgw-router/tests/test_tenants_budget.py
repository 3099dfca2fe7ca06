"""A budget's grants at the router (tenants/limits.py): over any interleaving of usage
reports, their replies (or lost replies) and requests that start and end, the tokens
used never sum above the budget. The control plane is modelled as its ReportUsage
does it: a report is counted once (a re-sent one is not counted again) and the reply
grants what is left of the budget."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_proto.v1 import KeyShare, UsageReply
from llmgw_router.config import ApiKey, RouterConfig
from llmgw_router.control.keys import KeysClient
from llmgw_router.endpoints import EndpointSet
from llmgw_router.metrics import Metrics
from llmgw_router.state import RouterState
from llmgw_router.tenants.gate import Share, Tenancy
from llmgw_router.tenants.limits import KeyLimits, KeyState, Reservation


@dataclass
class _Fleet:
    budget: int
    state: KeyState
    counted: int = 0  # the control plane's count of the period's usage
    since: int = 0  # used since the last report was taken (the next report's)
    pending: int | None = None  # the report sent and not yet answered
    pending_counted: bool = False
    used: int = 0  # every token used
    flight: list[tuple[Reservation, int]] = field(default_factory=list)

    def take(self) -> None:
        if self.pending is None:
            self.pending, self.since = self.since, 0
            self.pending_counted = False
            self.state.reported()

    def reply(self, lost: bool) -> None:
        if self.pending is None:
            return
        if not self.pending_counted:
            self.counted += self.pending
            self.pending_counted = True
        if lost:
            return  # the router sends the same report again; counted once
        self.pending = None
        self.state.grant(max(0, self.budget - self.counted))

    def start(self, tokens: int) -> None:
        got = self.state.try_reserve(tokens, 0.0)
        if isinstance(got, Reservation):
            self.flight.append((got, tokens))

    def end(self, index: int, part: float) -> None:
        if not self.flight:
            return
        reservation, tokens = self.flight.pop(index % len(self.flight))
        actual = int(tokens * part)  # never more than reserved
        self.state.release(reservation, actual, 0.0)
        self.used += actual
        self.since += actual


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("take"), st.just(0), st.just(0.0)),
        st.tuples(st.just("reply"), st.booleans().map(int), st.just(0.0)),
        st.tuples(st.just("start"), st.integers(1, 400), st.just(0.0)),
        st.tuples(st.just("end"), st.integers(0, 50), st.floats(0.0, 1.0)),
    ),
    max_size=120,
)


def _run(budget: int, ops: list[tuple[str, int, float]]) -> _Fleet:
    fleet = _Fleet(budget, KeyState(KeyLimits(budget_tokens=budget), 0.0))
    fleet.state.grant(budget)
    for op, n, part in ops:
        if op == "take":
            fleet.take()
        elif op == "reply":
            fleet.reply(lost=bool(n))
        elif op == "start":
            fleet.start(n)
        else:
            fleet.end(n, part)
        # What was used, and what requests in flight may still use, fit the budget.
        in_flight = sum(tokens for _, tokens in fleet.flight)
        assert fleet.used + in_flight <= budget, (fleet.used, in_flight, budget)
    return fleet


@given(budget=st.integers(1, 2000), ops=_ops)
@settings(max_examples=400, deadline=None)
def test_usage_never_exceeds_the_budget(budget: int, ops: list[tuple[str, int, float]]) -> None:
    fleet = _run(budget, ops)
    for reservation, _ in fleet.flight:
        fleet.state.release(reservation, None, 0.0)
    assert fleet.used <= budget


def test_a_request_that_ends_while_the_report_is_out_is_not_granted_again() -> None:
    # 1000 budget; 600 reserved; the report is taken (nothing used yet); the request
    # ends having used 600; the reply grants 1000 (the control plane saw none of it):
    # 400 may still be used, not 1000.
    fleet = _run(1000, [("start", 600, 0.0), ("take", 0, 0.0), ("end", 0, 1.0)])
    fleet.reply(lost=False)
    assert fleet.state.budget_left == 400


async def test_a_request_that_spans_a_report_is_in_the_next_one() -> None:
    # Admitted before a report is taken, ended after: its tokens are in the next report
    # (they were dropped: the usage entry went with the taken report), and the grant
    # applied meanwhile leaves them out.
    config = RouterConfig()
    state = RouterState(config, EndpointSet((), source="static"), Metrics())
    tenancy = Tenancy(state, config.tenants)
    key = ApiKey(b"", "a", frozenset(), limits=KeyLimits(budget_tokens=10_000), local=False)
    tenancy.apply_shares([("a", Share(0, 0, 0, budget_tokens=10_000))], 5.0)
    ticket = await tenancy.admit(key, "m", (), b"x" * 400)
    client = KeysClient(tenancy, "r1")
    client.next_report()
    tenancy.done(ticket, 100, 50, 200)
    client.answered(UsageReply(shares=[KeyShare(key="a", budget_tokens=10_000)]))
    assert tenancy.keys["a"].budget_left == 10_000 - 150
    report = client.next_report()
    assert [(u.key, u.requests, u.prompt_tokens, u.completion_tokens) for u in report.usage] == [
        ("a", 0, 100, 50)
    ]
