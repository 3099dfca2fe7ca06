"""The one record of a shard, persisted in ``state_dir/shards/<shard>.json``.

It holds the StartShard itself, the launch built from it, the engine's pid and process
start time, where its output goes, and its state: everything a restarted agent needs to
re-adopt the engine, and the only copy every reader uses.
"""

from __future__ import annotations

import base64
import os
import re
from functools import cached_property
from pathlib import Path
from typing import Any

import msgspec
from llmgw_proto import v1

from llmgw_agent.adapters import Launch
from llmgw_agent.procs import is_same_process

__all__ = ["ShardRecord", "live_records", "read_records", "record_path"]


class ShardRecord(msgspec.Struct, kw_only=True, dict=True):
    """One launched shard."""

    # The StartShard as sent, serialized (protobuf, base64): nothing of it is lost.
    start_shard: str
    launch: Launch
    pid: int
    # /proc/PID/stat start time: a reused pid has another one.
    pid_start: int
    started_at: float
    load_timeout: float
    output_path: str
    state: str = "STARTING"

    @cached_property
    def start(self) -> v1.StartShard:
        return v1.StartShard.parse(base64.b64decode(self.start_shard))

    @property
    def shard_id(self) -> str:
        return self.start.shard_id

    @staticmethod
    def encode_start(start: v1.StartShard) -> str:
        return base64.b64encode(bytes(start)).decode()

    def alive(self) -> bool:
        return is_same_process(self.pid, self.pid_start, self.launch.argv)

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(self))
        os.replace(tmp, path)


def record_path(state_dir: Path, shard_id: str) -> Path:
    return state_dir / "shards" / f"{re.sub(r'[^A-Za-z0-9._-]', '_', shard_id) or '_'}.json"


def _decode(raw: bytes) -> ShardRecord:
    try:
        return msgspec.json.decode(raw, type=ShardRecord)
    except msgspec.ValidationError:
        # A record written by an agent before the launch was nested: same facts, flat.
        old: dict[str, Any] = msgspec.json.decode(raw)
        launch = Launch(
            **{k: old[k] for k in ("argv", "env", "health_url", "metrics_url", "endpoint_url")},
            headless=bool(old["headless"]),
        )
        fields = ("start_shard", "pid", "pid_start", "started_at", "load_timeout", "output_path")
        return ShardRecord(
            launch=launch, state=old.get("state", "STARTING"), **{k: old[k] for k in fields}
        )


def read_records(state_dir: Path) -> list[tuple[Path, ShardRecord | None]]:
    """Every record file and its record (None when it cannot be read)."""
    out: list[tuple[Path, ShardRecord | None]] = []
    shards = state_dir / "shards"
    if not shards.is_dir():
        return out
    for path in sorted(shards.glob("*.json")):
        try:
            out.append((path, _decode(path.read_bytes())))
        except (OSError, msgspec.DecodeError, KeyError, TypeError):
            out.append((path, None))
    return out


def live_records(state_dir: Path) -> list[ShardRecord]:
    """Recorded shards whose engine still runs (same pid, start time and command line)."""
    return [r for _, r in read_records(state_dir) if r is not None and r.alive()]
