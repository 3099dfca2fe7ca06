"""The parts of admission that hold no clock and no I/O: a key's lookup by its secret,
its share and usage records, a request's ticket and one model's gate (gate.py uses them)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from dataclasses import dataclass, field

from llmgw_router.config import ApiKey
from llmgw_router.endpoints import Endpoint
from llmgw_router.tenants.fair import FairQueue, Held
from llmgw_router.tenants.limits import KeyState, Reservation

__all__ = [
    "Gate",
    "Share",
    "Ticket",
    "Usage",
    "enter",
    "leave",
    "lookup_secret",
    "period_of",
    "under_share",
]


def lookup_secret(by_prefix: dict[str, ApiKey], token: bytes) -> ApiKey | None:
    """A control-plane key by its secret: found by prefix (`llmgw_<8 hex>`), then the
    secret's SHA-256 compared in constant time."""
    cut = token.find(b"_", 6)
    if cut < 0 or not token.startswith(b"llmgw_"):
        return None
    key = by_prefix.get(token[:cut].decode("latin-1"))
    if key is None:
        return None
    digest = hashlib.sha256(token).hexdigest()
    return key if hmac.compare_digest(digest, key.sha256) else None


@dataclass(slots=True)
class Share:
    """This router's part of a key's fleet-wide limits, from the control plane."""

    rpm: float
    tpm: float
    max_concurrent: int
    budget_tokens: int


@dataclass(slots=True)
class Usage:
    """One key's usage since the last report (ReportUsage's KeyUsage)."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors: int = 0
    refused: int = 0
    held_seconds: float = 0.0
    # Requests and tokens asked for, admitted or not: the demand.
    asked: int = 0
    asked_tokens: int = 0


@dataclass(slots=True)
class Ticket:
    """What one admitted request holds until :meth:`Tenancy.done`."""

    key: str
    band: str
    model: str
    state: KeyState | None
    reservation: Reservation | None
    gated: bool
    # The band's index (0: the highest).
    level: int = 0
    held: float = 0.0
    done: bool = False
    # The model's gate, once through it without a wait (saves done() the lookup).
    gate: Gate | None = None


@dataclass(slots=True)
class Gate:
    """One model's requests in flight through the gate, and those held."""

    queue: FairQueue[asyncio.Future[None]]
    candidates: tuple[Endpoint, ...] = ()
    in_flight: int = 0
    # In flight through the gate per key (for the keys' fair shares of the cap) and per
    # band.
    by_key: dict[str, int] = field(default_factory=dict)
    by_band: list[int] = field(default_factory=list)
    # Held requests by id(future): their place in the queue and when they came.
    waiters: dict[int, tuple[Held[asyncio.Future[None]], float]] = field(default_factory=dict)


def enter(gate: Gate, key: str, band: int) -> None:
    """A request of ``key`` in ``band`` goes through the gate: counted in flight."""
    gate.in_flight += 1
    gate.by_band[band] += 1
    gate.by_key[key] = gate.by_key.get(key, 0) + 1


def leave(gate: Gate, key: str, band: int) -> None:
    """A request of ``key`` in ``band`` that went through is done: counted out (a key
    with none left in flight leaves ``by_key``)."""
    gate.in_flight -= 1
    gate.by_band[band] -= 1
    left = gate.by_key.get(key, 0) - 1
    if left > 0:
        gate.by_key[key] = left
    else:
        gate.by_key.pop(key, None)


def under_share(gate: Gate, key: str, room: int) -> bool:
    """``key`` has fewer in flight than an equal share of ``room`` among the keys in flight."""
    mine = gate.by_key.get(key, 0)
    keys = len(gate.by_key) + (0 if mine else 1)
    return mine * keys < room


def period_of(kind: str, wall: float) -> str:
    """The name of the budget period (``kind``: "month", else a day; UTC) that the
    wall-clock time ``wall`` falls in: "2026-12" for a month, "2026-336" (the day of
    the year) for a day. A key's budget starts again when it changes."""
    t = time.gmtime(wall)
    return f"{t.tm_year}-{t.tm_mon:02d}" if kind == "month" else f"{t.tm_year}-{t.tm_yday}"
