"""State stores: what the control plane must not forget, in SQLite, etcd or PostgreSQL."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from llmgw_control.config import StateSettings
from llmgw_control.store.base import SCHEMA_VERSION, Change, NotLeader, Records, Store, StoreError

if TYPE_CHECKING:
    from llmgw_control.store.etcd import EtcdBackend
    from llmgw_control.store.postgres import PostgresBackend

__all__ = [
    "SCHEMA_VERSION",
    "Change",
    "NotLeader",
    "Records",
    "Store",
    "StoreError",
    "leader_backend",
    "make_store",
]


def make_store(settings: StateSettings, config_path: Path | None = None) -> Store:
    """The configured backend (not opened yet); relative state_dir is from the config file."""
    if settings.backend == "etcd":
        from llmgw_control.store.etcd import EtcdStore

        return EtcdStore(settings.etcd)
    if settings.backend == "postgres":
        from llmgw_control.store.postgres import PostgresStore

        return PostgresStore(settings.postgres)
    from llmgw_control.store.sqlite import SqliteStore

    state_dir = Path(settings.state_dir).expanduser()
    if not state_dir.is_absolute() and config_path is not None:
        state_dir = config_path.resolve().parent / state_dir
    return SqliteStore(state_dir)


def leader_backend(
    store: Store, instance: str, address: str, lease_ttl: float
) -> EtcdBackend | PostgresBackend:
    """The store's own hold on the lead (its writes are then fenced on it): etcd's lease
    and leader key, or PostgreSQL's advisory lock. SQLite has none (one instance only)."""
    from llmgw_control.store.etcd import EtcdBackend, EtcdStore
    from llmgw_control.store.postgres import PostgresBackend, PostgresStore

    if isinstance(store, EtcdStore):
        return EtcdBackend(store, instance, address, lease_ttl)
    if isinstance(store, PostgresStore):
        return PostgresBackend(store, instance, address, lease_ttl)
    raise ValueError(f"{type(store).__name__} cannot elect a leader: HA needs etcd or PostgreSQL")
