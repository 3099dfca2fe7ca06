"""Keys (pure): settings checked with the flag named, secrets, records, budget periods."""

from __future__ import annotations

import datetime as dt
import hashlib
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from llmgw_control import keys
from llmgw_control.keys import KeyInputError, KeyRecord


def test_secret_format_and_prefix() -> None:
    secret = keys.make_secret()
    assert re.fullmatch(r"llmgw_[0-9a-f]{8}_[A-Za-z0-9_-]{32,}", secret)
    assert keys.secret_prefix(secret) == secret[:14]
    record = keys.apply_fields(None, "team-a", {}, 1.0, secret)
    assert record.prefix == secret[:14]
    assert record.sha256 == hashlib.sha256(secret.encode()).hexdigest()
    assert secret not in keys.encode(record).decode()


def test_make_secret_avoids_taken_prefixes() -> None:
    taken = {keys.secret_prefix(keys.make_secret()) for _ in range(50)}
    for _ in range(50):
        assert keys.secret_prefix(keys.make_secret(taken)) not in taken


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"rpm": "-1"}, "--rpm: expected a whole number from 0 to 4294967295, got '-1'"),
        ({"rpm": "ten"}, "--rpm: expected a whole number"),
        ({"tpm": 2**64}, "--tpm: expected a whole number"),
        ({"max_concurrent": True}, "--max-concurrent: expected a whole number"),
        ({"weight": "0"}, "--weight: expected a whole number from 1 to 1000000"),
        ({"budget_tokens": "1.5"}, "--budget-tokens: expected a whole number"),
        ({"budget_period": "week"}, "--budget-period: expected day or month, got 'week'"),
        ({"priority": "High!"}, "--priority: 'High!' is not a priority name"),
        ({"models": "a b,c"}, "--models: 'a b' is not a model name"),
        ({"models": 3}, "--models: expected model names separated by commas"),
        ({"revoked": True}, "'revoked' is not a key setting"),
    ],
)
def test_bad_settings_name_the_flag(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(KeyInputError) as err:
        keys.check_fields(fields)
    assert message in str(err.value)


def test_good_settings() -> None:
    got = keys.check_fields(
        {
            "models": "m1, m2,m1,",
            "rpm": "60",
            "tpm": 1000,
            "max_concurrent": "1_000",
            "priority": "batch",
            "weight": "3",
            "budget_tokens": "5000",
            "budget_period": "day",
            "tpm_not_given": None,
        }
        | {"tpm_not_given": None}
    )
    assert got == {
        "models": ("m1", "m2"),
        "rpm": 60,
        "tpm": 1000,
        "max_concurrent": 1000,
        "priority": "batch",
        "weight": 3,
        "budget_tokens": 5000,
        "budget_period": "day",
    }
    assert keys.check_fields({"models": ""}) == {"models": ()}


@pytest.mark.parametrize("name", ["", "-x", "a/b", "x" * 65, "a b", "é"])
def test_bad_names(name: str) -> None:
    with pytest.raises(KeyInputError, match=r"NAME: .* is not a key name"):
        keys.check_name(name)


def test_budget_needs_a_period_and_the_other_way_round() -> None:
    secret = keys.make_secret()
    with pytest.raises(KeyInputError, match="--budget-tokens: needs --budget-period"):
        keys.apply_fields(None, "k", {"budget_tokens": 10}, 0.0, secret)
    with pytest.raises(KeyInputError, match="--budget-period: needs --budget-tokens"):
        keys.apply_fields(None, "k", {"budget_period": "day"}, 0.0, secret)
    k = keys.apply_fields(None, "k", {"budget_tokens": 10, "budget_period": "day"}, 0.0, secret)
    # A budget of 0 removes the budget, its period with it.
    off = keys.apply_fields(k, "k", {"budget_tokens": 0}, 1.0)
    assert (off.budget_tokens, off.budget_period, off.updated) == (0, "", 1.0)


def test_period_start_is_utc_day_or_month() -> None:
    at = dt.datetime(2026, 12, 2, 15, 30, tzinfo=dt.UTC).timestamp()
    assert keys.period_start("day", at) == dt.datetime(2026, 12, 2, tzinfo=dt.UTC).timestamp()
    assert keys.period_start("month", at) == dt.datetime(2026, 12, 1, tzinfo=dt.UTC).timestamp()


_settings = st.fixed_dictionaries(
    {},
    optional={
        "models": st.lists(st.from_regex(r"[a-z0-9/._-]{1,12}", fullmatch=True), max_size=4),
        "rpm": st.integers(0, 2**32 - 1),
        "tpm": st.integers(0, 2**63 - 1),
        "max_concurrent": st.integers(0, 2**32 - 1),
        "priority": st.sampled_from(["interactive", "default", "batch"]),
        "weight": st.integers(1, 1_000_000),
    },
)


@given(_settings, st.integers(1, 2**40), st.sampled_from(["day", "month"]))
def test_record_round_trips_through_the_store_and_the_wire(
    fields: dict[str, Any], budget: int, period: str
) -> None:
    checked = keys.check_fields({**fields, "budget_tokens": budget, "budget_period": period})
    record = keys.apply_fields(None, "k", checked, 5.0, keys.make_secret())
    assert keys.decode(keys.encode(record)) == record
    msg = record.message()
    assert (msg.name, msg.prefix, msg.sha256, msg.rpm, msg.budget_tokens) == (
        record.name,
        record.prefix,
        record.sha256,
        record.rpm,
        record.budget_tokens,
    )


@given(st.dictionaries(st.sampled_from(sorted(keys.FLAGS)), st.text(max_size=8), max_size=4))
def test_any_text_is_taken_or_refused_naming_its_flag(fields: dict[str, str]) -> None:
    try:
        keys.check_fields(fields)
    except KeyInputError as err:
        why = str(err)
    else:
        return
    assert any(why.startswith(keys.FLAGS[f] + ":") for f in fields)


@given(st.text(max_size=80))
def test_any_name_is_taken_or_refused(name: str) -> None:
    try:
        taken = keys.check_name(name)
    except KeyInputError as err:
        assert str(err).startswith("NAME: ")  # noqa: PT017 - any text, either way
        return
    assert taken == name


def test_limited() -> None:
    base = KeyRecord(name="k", prefix="p", sha256="h")
    assert not base.limited
    assert KeyRecord(name="k", prefix="p", sha256="h", rpm=1).limited
