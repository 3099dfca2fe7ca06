"""The one shard record: written once, read back by a restarted agent, old layout too."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from llmgw_agent.adapters import Launch
from llmgw_agent.procs import process_start_ticks
from llmgw_agent.records import ShardRecord, live_records, read_records, record_path
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
