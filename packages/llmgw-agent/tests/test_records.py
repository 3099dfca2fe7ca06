"""The one shard record: written once, read back by a restarted agent, old layout too."""

from __future__ import annotations

import base64
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llmgw_agent.adapters import Launch
from llmgw_agent.procs import process_start_ticks
from llmgw_agent.records import (
    ShardRecord,
    live_records,
    private_dir,
    read_records,
    record_path,
    remove_leftovers,
)
from llmgw_proto import v1


def test_record_round_trip_and_the_previous_layout(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    proc = subprocess.Popen(argv, start_new_session=True)
    try:
        start = v1.StartShard(shard_id="m.p.1-0", replica_id="m.p.1", port=20001)
        ticks = process_start_ticks(proc.pid)
        assert ticks is not None
        launch = Launch(
            argv=argv, env={}, health_url="h", metrics_url="m", endpoint_url="e", headless=False
        )
        record = ShardRecord(
            start_shard=ShardRecord.encode_start(start),
            launch=launch,
            pid=proc.pid,
            pid_start=ticks,
            started_at=1.0,
            load_timeout=5.0,
            output_path=str(tmp_path / "out.log"),
        )
        path = record_path(tmp_path, start.shard_id)
        path.parent.mkdir(parents=True)
        record.save(path)
        [(found_path, found)] = read_records(tmp_path)
        assert found_path == path
        assert found == record
        assert found is not None
        assert found.start == start
        assert [r.shard_id for r in live_records(tmp_path)] == ["m.p.1-0"]

        # A record written before the launch was nested (flat fields) still re-adopts.
        old = {
            "shard_id": start.shard_id, "replica_id": "m.p.1", "model": "m", "profile": "p",
            "engine": "vllm", "pid": proc.pid, "pid_start": ticks, "argv": argv, "env": {},
            "started_at": 1.0, "port": 20001, "gpu_indices": [], "rank": 0, "world_size": 1,
            "endpoint_url": "e", "health_url": "h", "metrics_url": "m", "headless": False,
            "load_timeout": 5.0, "state": "READY", "output_path": "o",
            "start_shard": base64.b64encode(bytes(start)).decode(),
        }  # fmt: skip
        path.write_text(json.dumps(old))
        [(_, legacy)] = read_records(tmp_path)
        assert legacy is not None
        assert legacy.launch == launch
        assert legacy.state == "READY"
        assert legacy.alive()
        # Garbage is reported as unreadable, not raised.
        path.write_text("{not json")
        assert read_records(tmp_path) == [(path, None)]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert live_records(tmp_path) == []


def sample_record(
    tmp_path: Path, pid: int = 4242, env: dict[str, str] | None = None
) -> ShardRecord:
    start = v1.StartShard(shard_id="m.p.1-0", replica_id="m.p.1", port=20001)
    launch = Launch(
        argv=["engine"], env=env or {}, health_url="h", metrics_url="m", endpoint_url="e",
        headless=False,
    )  # fmt: skip
    return ShardRecord(
        start_shard=ShardRecord.encode_start(start),
        launch=launch,
        pid=pid,
        pid_start=1,
        started_at=1.0,
        load_timeout=5.0,
        output_path=str(tmp_path / "out.log"),
    )


def test_records_are_private_in_a_private_directory(tmp_path: Path) -> None:
    # Issue 24: records hold the profile's env (an HF_TOKEN) and were 0644 in a 0755
    # directory. A directory an older agent made 0755, and its 0644 record, are tightened.
    shards = tmp_path / "shards"
    shards.mkdir(mode=0o755)
    os.chmod(shards, 0o755)
    path = record_path(tmp_path, "m.p.1-0")
    path.write_text("{}")
    os.chmod(path, 0o644)
    private_dir(shards)
    sample_record(tmp_path, env={"HF_TOKEN": "hf_secret"}).save(path)
    assert stat.S_IMODE(shards.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert private_dir(tmp_path / "new" / "logs") == tmp_path / "new" / "logs"
    assert stat.S_IMODE((tmp_path / "new" / "logs").stat().st_mode) == 0o700


def test_a_crash_mid_write_leaves_the_previous_record_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = record_path(tmp_path, "m.p.1-0")
    private_dir(path.parent)
    first = sample_record(tmp_path, pid=1111)
    first.save(path)
    before = path.read_bytes()

    # The write dies half way (the disk fills, the process is killed): the record at
    # its path is still the previous one, whole, and no temporary file is left.
    real_write = os.write

    def half(fd: int, data: Any) -> int:
        real_write(fd, bytes(data)[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", half)
    with pytest.raises(OSError, match="No space left"):
        sample_record(tmp_path, pid=2222).save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    assert read_records(tmp_path) == [(path, first)]

    # A process killed mid-write leaves its temporary file: never read as a record,
    # removed by the next agent.
    leftover = path.parent / f".{path.name}.999.tmp"
    leftover.write_bytes(before[: len(before) // 2])
    assert read_records(tmp_path) == [(path, first)]
    assert remove_leftovers(tmp_path) == [leftover]
    assert not leftover.exists()


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cut=st.floats(min_value=0.0, max_value=0.999))
def test_a_torn_record_reads_as_unreadable_never_raises(tmp_path: Path, cut: float) -> None:
    # A record cut anywhere (written by an agent without the atomic write, or a disk
    # that lost its tail) is reported as unreadable: the agent logs and goes on.
    path = record_path(tmp_path, "m.p.1-0")
    private_dir(path.parent)
    whole = msgspec.json.encode(sample_record(tmp_path))
    path.write_bytes(whole[: int(len(whole) * cut)])
    assert read_records(tmp_path) == [(path, None)]
