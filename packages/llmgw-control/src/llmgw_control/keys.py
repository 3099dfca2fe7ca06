"""API keys as the control plane keeps them: made, checked, stored hashed (pure).

A key's secret is ``llmgw_<8 hex>_<32 urlsafe characters>``; its first part (the
*prefix*, ``llmgw_<8 hex>``) is not secret and identifies the key in lookups and logs,
as GitHub's tokens do. The store and the routers get only the prefix and the hex
SHA-256 of the whole secret; the secret itself is printed once by ``keys create``.

Everything here is pure: :func:`check_fields` turns what an operator typed (flag ->
text or number) into checked values or a :class:`KeyInputError` naming the flag;
:func:`apply_fields` makes or changes a :class:`KeyRecord`; the record is stored as
JSON under the store kind :data:`KIND`, keyed by name.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from llmgw_proto import v1

__all__ = [
    "FLAGS",
    "KIND",
    "PERIODS",
    "KeyInputError",
    "KeyRecord",
    "apply_fields",
    "check_fields",
    "check_name",
    "decode",
    "encode",
    "make_secret",
    "period_start",
    "secret_prefix",
]

# The store's record kind for keys, keyed by key name.
KIND = "apikey"
PERIODS = ("day", "month")
SECRET_HEAD = "llmgw_"  # noqa: S105 - the non-secret head of every secret
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_PRIORITY = re.compile(r"[a-z][a-z0-9_-]{0,31}")
_MODEL = re.compile(r"[^\s,]{1,256}")
U32 = 2**32 - 1
U63 = 2**63 - 1
MAX_WEIGHT = 1_000_000
MAX_MODELS = 256

# Field -> the CLI flag an operator types, named in every error.
FLAGS = {
    "models": "--models",
    "rpm": "--rpm",
    "tpm": "--tpm",
    "max_concurrent": "--max-concurrent",
    "priority": "--priority",
    "weight": "--weight",
    "budget_tokens": "--budget-tokens",
    "budget_period": "--budget-period",
}
_INTS = {
    "rpm": (0, U32),
    "tpm": (0, U63),
    "max_concurrent": (0, U32),
    "weight": (1, MAX_WEIGHT),
    "budget_tokens": (0, U63),
}


class KeyInputError(ValueError):
    """Bad input for a key; the message names the flag (or the name) and what is wrong."""


@dataclass(frozen=True)
class KeyRecord:
    name: str
    prefix: str
    sha256: str
    models: tuple[str, ...] = ()
    rpm: int = 0
    tpm: int = 0
    max_concurrent: int = 0
    priority: str = "default"
    weight: int = 1
    budget_tokens: int = 0
    budget_period: str = ""
    revoked: bool = False
    # Wall-clock seconds.
    created: float = 0.0
    updated: float = 0.0

    @property
    def limited(self) -> bool:
        """Has any fleet-wide limit (the routers then get a share of it)."""
        return bool(self.rpm or self.tpm or self.max_concurrent or self.budget_tokens)

    def message(self) -> v1.ApiKey:
        return v1.ApiKey(
            name=self.name,
            prefix=self.prefix,
            sha256=self.sha256,
            models=list(self.models),
            rpm=self.rpm,
            tpm=self.tpm,
            max_concurrent=self.max_concurrent,
            priority=self.priority,
            weight=self.weight,
            budget_tokens=self.budget_tokens,
            budget_period=self.budget_period,
            revoked=self.revoked,
        )

    def limits(self) -> dict[str, Any]:
        """What ``keys list`` and status show (never the hash)."""
        return {
            "name": self.name,
            "prefix": self.prefix,
            "models": list(self.models),
            "rpm": self.rpm,
            "tpm": self.tpm,
            "max_concurrent": self.max_concurrent,
            "priority": self.priority,
            "weight": self.weight,
            "budget_tokens": self.budget_tokens,
            "budget_period": self.budget_period,
            "revoked": self.revoked,
        }


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise KeyInputError(
            f"NAME: {name!r} is not a key name: 1 to 64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def _int(field: str, value: Any) -> int:
    flag = FLAGS[field]
    low, high = _INTS[field]
    if isinstance(value, bool):
        number = None
    elif isinstance(value, int):
        number = value
    elif isinstance(value, str) and re.fullmatch(r"\s*[0-9_]+\s*", value) and value.strip("_ "):
        number = int(value.strip().replace("_", ""))
    else:
        number = None
    if number is None or not low <= number <= high:
        raise KeyInputError(f"{flag}: expected a whole number from {low} to {high}, got {value!r}")
    return number


def check_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The fields an operator gave (None: not given), checked; KeyInputError names the flag.

    Numbers may come as numbers or as text; ``models`` as a comma-separated text or a list
    (empty: any model).
    """
    out: dict[str, Any] = {}
    for field, value in fields.items():
        if value is None:
            continue
        if field not in FLAGS:
            raise KeyInputError(f"{field!r} is not a key setting (known: {', '.join(FLAGS)})")
        flag = FLAGS[field]
        if field in _INTS:
            out[field] = _int(field, value)
        elif field == "models":
            items = value.split(",") if isinstance(value, str) else value
            if not isinstance(items, list | tuple) or not all(isinstance(m, str) for m in items):
                raise KeyInputError(f"{flag}: expected model names separated by commas")
            names = [m.strip() for m in items if m.strip()]
            for m in names:
                if not _MODEL.fullmatch(m):
                    raise KeyInputError(f"{flag}: {m!r} is not a model name")
            if len(names) > MAX_MODELS:
                raise KeyInputError(f"{flag}: at most {MAX_MODELS} models, got {len(names)}")
            out[field] = tuple(dict.fromkeys(names))
        elif field == "priority":
            if not isinstance(value, str) or not _PRIORITY.fullmatch(value):
                raise KeyInputError(
                    f"{flag}: {value!r} is not a priority name: 1 to 32 lower-case letters, "
                    "digits, '_' or '-', starting with a letter (e.g. interactive, default, batch)"
                )
            out[field] = value
        else:  # budget_period
            if value not in PERIODS and value != "":
                raise KeyInputError(f"{flag}: expected day or month, got {value!r}")
            out[field] = value
    return out


def apply_fields(
    existing: KeyRecord | None,
    name: str,
    fields: Mapping[str, Any],
    now: float,
    secret: str | None = None,
) -> KeyRecord:
    """A new key (``existing`` None, ``secret`` given) or ``existing`` changed by the
    checked ``fields``; KeyInputError when the result is inconsistent (a budget needs
    a period and a period a budget)."""
    if existing is None:
        if secret is None:
            raise ValueError("a new key needs its secret")
        base = KeyRecord(
            name=name,
            prefix=secret_prefix(secret),
            sha256=hashlib.sha256(secret.encode()).hexdigest(),
            created=now,
        )
    else:
        base = existing
    changed = dataclasses.replace(base, **dict(fields), updated=now)
    if "budget_tokens" in fields and changed.budget_tokens == 0 and "budget_period" not in fields:
        changed = dataclasses.replace(changed, budget_period="")
    if changed.budget_tokens and not changed.budget_period:
        raise KeyInputError("--budget-tokens: needs --budget-period day or month")
    if changed.budget_period and not changed.budget_tokens:
        raise KeyInputError("--budget-period: needs --budget-tokens N (more than 0)")
    return changed


def make_secret(taken_prefixes: set[str] | frozenset[str] = frozenset()) -> str:
    """A new secret whose prefix no other key has."""
    while True:
        prefix = SECRET_HEAD + secrets.token_hex(4)
        if prefix not in taken_prefixes:
            return f"{prefix}_{secrets.token_urlsafe(24)}"


def secret_prefix(secret: str) -> str:
    """``llmgw_<8 hex>`` of a secret (the first 14 characters)."""
    return secret[: len(SECRET_HEAD) + 8]


def period_start(period: str, now: float) -> float:
    """Wall-clock start (UTC) of the budget period ``now`` falls in: the day's or month's."""
    at = dt.datetime.fromtimestamp(now, dt.UTC)
    day = at.replace(hour=0, minute=0, second=0, microsecond=0)
    start = day.replace(day=1) if period == "month" else day
    return start.timestamp()


class _Stored(msgspec.Struct, omit_defaults=True):
    name: str
    prefix: str
    sha256: str
    models: list[str] = []
    rpm: int = 0
    tpm: int = 0
    max_concurrent: int = 0
    priority: str = "default"
    weight: int = 1
    budget_tokens: int = 0
    budget_period: str = ""
    revoked: bool = False
    created: float = 0.0
    updated: float = 0.0


def encode(record: KeyRecord) -> bytes:
    d = dataclasses.asdict(record)
    d["models"] = list(record.models)
    return msgspec.json.encode(_Stored(**d))


def decode(data: bytes) -> KeyRecord:
    s = msgspec.json.decode(data, type=_Stored)
    fields = {f.name: getattr(s, f.name) for f in dataclasses.fields(KeyRecord)}
    fields["models"] = tuple(s.models)
    return KeyRecord(**fields)
