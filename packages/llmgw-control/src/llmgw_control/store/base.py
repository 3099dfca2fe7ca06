"""What every state store offers: keyed records in kinds, written in atomic batches.

The control plane keeps a few kinds of records (``node``, ``replica``, ``publish``,
``override``, ``meta`` ...; other modules may add their own, e.g. ``rollout``). A
record is opaque bytes under ``(kind, key)``. A store loads them all at start and
writes batches of changes, each batch all or nothing. In a highly available setup
a batch is written only while this instance leads (the write is *fenced*): a
deposed leader's write fails with :class:`NotLeader`.

A store that cannot be read raises :class:`StoreError` naming the store and the
reason; the control plane then refuses to start rather than start empty.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "SCHEMA_VERSION",
    "Change",
    "NotLeader",
    "Records",
    "Store",
    "StoreError",
    "check_schema",
]

# Bump when the layout of the records changes; a store holding a newer one is refused.
SCHEMA_VERSION = 1

Records = dict[str, dict[str, bytes]]


class StoreError(Exception):
    """The store cannot be used; the message names the store (and its setting) and why."""


class NotLeader(StoreError):
    """A fenced write was refused: this instance does not lead (any more)."""


@dataclass(frozen=True)
class Change:
    kind: str
    key: str
    # None deletes the record.
    value: bytes | None


class Store(Protocol):
    """One backend: sqlite (embedded default), etcd or PostgreSQL."""

    # What an operator reads in an error: backend and where, e.g. "sqlite store /x/state.db".
    description: str

    async def open(self) -> None:
        """Connect and check the schema (creating it in an empty store); StoreError if not."""

    async def load(self) -> Records:
        """Every record, by kind and key."""

    async def write(self, changes: Sequence[Change]) -> None:
        """Apply ``changes`` atomically (NotLeader when fenced out, StoreError otherwise)."""

    async def close(self) -> None: ...


def check_schema(description: str, found: int | None, setting: str) -> None:
    """``found`` is the stored schema version (None: an empty store, about to be made)."""
    if found is None or found == SCHEMA_VERSION:
        return
    if found > SCHEMA_VERSION:
        raise StoreError(
            f"{description}: holds schema version {found}, written by a newer llmgw-control "
            f"(this one reads version {SCHEMA_VERSION}); upgrade llmgw-control or point "
            f"{setting} at another store"
        )
    raise StoreError(
        f"{description}: holds schema version {found}, this llmgw-control reads only "
        f"version {SCHEMA_VERSION}; point {setting} at another store"
    )


def group(changes: Sequence[Change]) -> Mapping[tuple[str, str], bytes | None]:
    """Last change per record wins, in order: a batch is written as its net effect."""
    out: dict[tuple[str, str], bytes | None] = {}
    for c in changes:
        out[(c.kind, c.key)] = c.value
    return out
