"""State stores: what the control plane must not forget, in SQLite, etcd or PostgreSQL."""

from __future__ import annotations

from pathlib import Path

from llmgw_control.config import StateSettings
from llmgw_control.store.base import SCHEMA_VERSION, Change, NotLeader, Records, Store, StoreError

__all__ = [
    "SCHEMA_VERSION",
    "Change",
    "NotLeader",
    "Records",
    "Store",
    "StoreError",
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
