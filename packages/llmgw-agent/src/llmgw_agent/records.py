"""The one record of a shard, persisted in ``state_dir/shards/<shard>.json``.

It holds the StartShard itself, the launch built from it, the engine's pid and process
start time, where its output goes, and its state: everything a restarted agent needs to
re-adopt the engine, and the only copy every reader uses.

Records hold the profile's ``env`` (tokens among them): they are written 0600 in a 0700
directory, atomically (a temporary file, fsync, rename, fsync of the directory), so a
crash leaves either the old record or the new one at the record's path, never half.
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

__all__ = [
    "ShardRecord",
    "live_records",
    "private_dir",
    "read_records",
    "record_path",
    "remove_leftovers",
    "write_private",
]

# Records and engine logs: readable by the agent's user only.
FILE_MODE = 0o600
DIR_MODE = 0o700


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
        write_private(path, msgspec.json.encode(self))


def private_dir(path: Path) -> Path:
    """``path`` as a directory only its owner may enter (an older agent's 0755 tightened)."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o777 != DIR_MODE:
        os.chmod(path, DIR_MODE)
    return path


def write_private(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically, mode 0600, durable once this returns."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)  # a leftover temporary file keeps its old mode otherwise
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


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
    """Every record file and its record (None when it cannot be read: torn, garbage)."""
    out: list[tuple[Path, ShardRecord | None]] = []
    shards = state_dir / "shards"
    if not shards.is_dir():
        return out
    for path in sorted(shards.glob("*.json")):
        if path.name.startswith("."):
            continue  # a temporary file of an interrupted write
        try:
            record = _decode(path.read_bytes())
            record.start  # noqa: B018 (the StartShard inside must parse too)
        except Exception:  # torn or garbage, however it breaks: never the agent's end
            out.append((path, None))
        else:
            out.append((path, record))
    return out


def remove_leftovers(state_dir: Path) -> list[Path]:
    """Remove the temporary files of writes a crash interrupted; returns them."""
    shards = state_dir / "shards"
    if not shards.is_dir():
        return []
    found = sorted(shards.glob(".*.tmp"))
    for path in found:
        path.unlink(missing_ok=True)
    return found


def live_records(state_dir: Path) -> list[ShardRecord]:
    """Recorded shards whose engine still runs (same pid, start time and command line)."""
    return [r for _, r in read_records(state_dir) if r is not None and r.alive()]
