"""The retry decision (retry.py): properties over any inputs, plus worked examples."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st
from llmgw_router.retry import RetryPolicy, Verdict, after_failure, retry_tiers

reasons = st.sampled_from(["connect", "reset", "status_5xx", "status_429", "timeout_first_byte"])


class Spender:
    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.calls = 0

    def __call__(self, now: float) -> bool:
        self.calls += 1
        if self.tokens > 0:
            self.tokens -= 1
            return True
        return False


@given(
    st.integers(0, 10),
    st.booleans(),
    st.integers(0, 12),
    reasons,
    st.floats(0, 100),
    st.floats(0, 100),
    st.integers(0, 3),
)
def test_retry_only_within_every_limit(
    max_retries: int,
    on_429: bool,
    retries: int,
    reason: str,
    now: float,
    deadline: float,
    tokens: int,
) -> None:
    spend = Spender(tokens)
    verdict = after_failure(
        RetryPolicy(max_retries, on_429),
        retries=retries,
        reason=reason,
        now=now,
        deadline=deadline,
        spend=spend,
    )
    within = retries < max_retries and now < deadline and (on_429 or reason != "status_429")
    if verdict is Verdict.RETRY:
        assert within
        assert tokens > 0
    else:
        assert not within or tokens == 0
    # The budget is touched only for a retry every other rule allows.
    assert spend.calls == (1 if within else 0)


def test_give_up_reasons_in_order() -> None:
    policy = RetryPolicy(max_retries=2, retry_on_429=False)

    def decide(**kw: object) -> Verdict:
        args: dict[str, object] = {
            "retries": 0,
            "reason": "status_5xx",
            "now": 1.0,
            "deadline": 10.0,
            "spend": lambda now: True,
        }
        args.update(kw)
        return after_failure(policy, **args)  # type: ignore[arg-type]

    assert decide() is Verdict.RETRY
    assert decide(retries=2) is Verdict.RETRIES_SPENT
    assert decide(now=10.0) is Verdict.DEADLINE
    assert decide(reason="status_429") is Verdict.NO_RETRY_ON_429
    assert decide(spend=lambda now: False) is Verdict.BUDGET


@dataclass(frozen=True)
class Ep:
    id: str
    profile: str = "p"


endpoints = st.lists(
    st.builds(Ep, id=st.sampled_from("abcdefgh"), profile=st.sampled_from(["p", "q"])),
    max_size=8,
    unique_by=lambda e: e.id,
)


@given(endpoints, endpoints, st.data())
def test_retry_tiers(first: list[Ep], current: list[Ep], data: st.DataObject) -> None:
    tried = data.draw(st.lists(st.sampled_from([e.id for e in first] or ["z"]), max_size=4))
    refused = set(data.draw(st.lists(st.sampled_from("abcdefgh"), max_size=3)))
    fresh, again = retry_tiers(first, current, tried, refused)
    profiles = {e.profile for e in first}
    same_profile = [e for e in current if e.profile in profiles]
    pool = same_profile or current
    # Only current endpoints, in the first choice's profiles while any is there.
    assert all(e in pool for e in fresh + again)
    # First tier: never tried; second tier: neither the last failure nor a refusal.
    assert not {e.id for e in fresh} & set(tried)
    if tried:
        assert tried[-1] not in {e.id for e in again}
    assert not {e.id for e in again} & refused
    assert {e.id for e in fresh} == {e.id for e in pool} - set(tried)


def test_retry_tiers_example() -> None:
    a, b, c = Ep("a"), Ep("b"), Ep("c", profile="q")
    assert retry_tiers([a], [a, b, c], ["a"], set()) == [[b], [b]]
    # All of the profile tried: the one tried before the last failure comes back.
    assert retry_tiers([a], [a, b, c], ["b", "a"], set()) == [[], [b]]
    assert retry_tiers([a], [a, b, c], ["b", "a"], {"b"}) == [[], []]
    # The profile is gone from the current set: any endpoint will do.
    assert retry_tiers([a], [c], ["a"], set()) == [[c], [c]]
