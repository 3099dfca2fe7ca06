"""What needs attention (issue 29 points 7 and 9): `status` takes host:port and
LLMGW_ADMIN, exits 3 when something is wrong, `--watch` prints the time, reasons are
cut at a word, and a refused config reload shows in status until one succeeds.

The pure parts with examples and hypothesis; the CLI and the reload against a real
control plane over its real admin socket.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from llmgw_control.attention import clip, local_time, needs_attention, summary_line, watch_header

Factory = Callable[..., Any]


def model(name: str = "m", replicas: int = 1, **profile: Any) -> dict[str, Any]:
    fields = {"engine": "vllm", "gpus_per_node": 1, "replicas": replicas, **profile}
    return {"name": name, "profiles": {"p": fields}}


def test_needs_attention_names_each_kind() -> None:
    status: dict[str, Any] = {
        "config_reload_refused": {"at": "2026-01-01T00:00:00+00:00", "error": "bad: $.x"},
        "nodes": [
            {"node_id": "a", "state": "READY"},
            {"node_id": "b", "state": "UNREACHABLE"},
            {"node_id": "c", "state": "LOST"},
        ],
        "replicas": [
            {"replica_id": "m.p.1", "model": "m", "profile": "p", "state": "ready"},
            {"replica_id": "m.p.2", "model": "m", "profile": "p", "state": "starting"},
            {
                "replica_id": "m.p.3",
                "model": "m",
                "profile": "p",
                "state": "unplaced",
                "reason": "too few free GPUs",
            },
            {"replica_id": "m.p.4", "model": "m", "profile": "p", "state": "backoff"},
        ],
        "rollouts": [
            {"model": "m", "profile": "p", "state": "rolling", "reason": ""},
            {"model": "m", "profile": "q", "state": "stopped", "reason": "new replica failed"},
        ],
        "warnings": [{"replica_id": "m.p.1", "warning": "address 127.0.0.1 on loopback"}],
    }
    items = needs_attention(status)
    assert [(i["kind"], i["subject"]) for i in items] == [
        ("config", "config"),
        ("node", "b"),
        ("node", "c"),
        ("replica", "m.p.3"),
        ("replica", "m.p.4"),
        ("rollout", "m/q"),
        ("endpoint", "m.p.1"),
    ]
    assert items[3]["text"] == "m/p replica m.p.3 cannot be placed: too few free GPUs"
    assert items[1]["text"] == "node b is unreachable"
    assert summary_line(items) == (
        "needs attention: 1 refused reload, 1 unreachable endpoint, 2 nodes, 2 replicas, "
        "1 stopped rollout"
    )
    assert needs_attention({"nodes": [{"node_id": "a", "state": "READY"}]}) == []
    assert summary_line([]) == "nothing needs attention"


def test_clip_cuts_at_a_word() -> None:
    text = "retry in 4s: gpu-a/m.p.1-0: exited with 1: CUDA error: an illegal memory access"
    assert clip(text, 40) == "retry in 4s: gpu-a/m.p.1-0: exited with…"
    assert clip("short", 40) == "short"


@given(st.text(alphabet=st.sampled_from("ab cd,:\n"), max_size=200), st.integers(5, 120))
def test_clip_is_short_and_a_prefix_of_whole_words(text: str, width: int) -> None:
    out = clip(text, width)
    assert len(out) <= width
    flat = " ".join(text.split())
    if len(flat) <= width:
        assert out == flat
    else:
        assert out.endswith("…")
        kept = out.removesuffix("…")
        assert flat.startswith(kept)


def test_times_are_local() -> None:
    plus2 = dt.timezone(dt.timedelta(hours=2), "X")
    assert local_time("2026-12-02T06:00:00+00:00", tz=plus2) == "2026-12-02 08:00:00 X"
    assert local_time("not a time") == "not a time"
    head = watch_header([], 2.0, now=dt.datetime(2026, 12, 2, 6, 30, 5, tzinfo=plus2))
    assert head.startswith("2026-12-02 06:30:05 X  (every 2s")
    assert head.endswith("nothing needs attention")


# --- against a real control plane ------------------------------------------------------


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw_control", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **(env or {})},
    )


async def test_status_exit_host_port_env_and_refused_reload(
    control_factory: Factory, agent_factory: Factory
) -> None:
    control = control_factory([model("small")])
    agent = agent_factory(control.grpc_port, "gpu-a")
    agent.start()
    await control.until(
        lambda s: any(r["state"] == "ready" for r in s["replicas"]), "the replica ready"
    )
    hostport = f"127.0.0.1:{control.admin_port}"
    fine = await asyncio.to_thread(run_cli, "status", "--admin", hostport)
    assert fine.returncode == 0, fine.stderr
    assert "NEEDS ATTENTION" not in fine.stdout

    # A profile that cannot be placed: exit 3, and the section says why.
    control.rewrite([model("small"), model("huge", gpus_per_node=8)])
    assert control.proc is not None
    control.proc.signal(signal.SIGHUP)
    await control.until(
        lambda s: any(r["state"] == "unplaced" for r in s["replicas"]), "huge unplaced"
    )
    wrong = await asyncio.to_thread(run_cli, "status", env={"LLMGW_ADMIN": hostport})
    assert wrong.returncode == 3, wrong.stdout + wrong.stderr
    assert "NEEDS ATTENTION (1)" in wrong.stdout
    assert "huge/p replica" in wrong.stdout

    # A reload of a bad file is refused: status says so until a good one is read.
    control.config.write_text(control.config.read_text() + "\nnot_a_setting: 1\n")
    control.proc.signal(signal.SIGHUP)
    data = await control.until(
        lambda s: s if s.get("config_reload_refused") else None, "the refused reload in status"
    )
    assert "not_a_setting" in data["config_reload_refused"]["error"]
    assert data["attention"][0]["kind"] == "config"
    shown = await asyncio.to_thread(run_cli, "status", "--admin", hostport)
    assert "WARNING config reload refused at " in shown.stdout
    assert "config reload refused, the previous config runs" in shown.stdout
    control.rewrite([model("small")])
    control.proc.signal(signal.SIGHUP)
    await control.until(
        lambda s: not s.get("config_reload_refused") and not s["attention"],
        "the good reload clearing it",
    )
    ok = await asyncio.to_thread(run_cli, "status", "--admin", hostport)
    assert ok.returncode == 0, ok.stdout
