"""Engines found from the processes themselves: the mark in their environment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from llmgw_agent.procs import (
    AGENT_ENV,
    SHARD_ENV,
    marked_processes,
    marks,
    parse_environ,
    process_start_ticks,
    read_mark,
    stop_group,
)
from llmgw_testkit import wait_for_async

names = st.text(st.characters(codec="utf-8", exclude_characters="\0"), min_size=1, max_size=30)


def environ_bytes(env: dict[str, str]) -> bytes:
    return b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items())


@given(
    shard=names,
    agent=names,
    port=st.integers(min_value=1, max_value=65535),
    gpus=st.lists(st.integers(min_value=0, max_value=64), max_size=8),
    other=st.dictionaries(st.from_regex(r"[A-Z_]{1,8}", fullmatch=True), names, max_size=5),
)
def test_a_mark_reads_back_for_its_agent_only(
    shard: str, agent: str, port: int, gpus: list[int], other: dict[str, str]
) -> None:
    env = {**other, **marks(shard, agent, port, gpus)}
    parsed = parse_environ(environ_bytes(env))
    assert read_mark(parsed, agent) == (shard, port, tuple(gpus))
    assert read_mark(parsed, agent + "x") is None
    assert read_mark(other, agent) is None or SHARD_ENV in other


@given(raw=st.binary(max_size=300), agent=names)
def test_any_environ_bytes_parse_without_raising(raw: bytes, agent: str) -> None:
    mark = read_mark(parse_environ(raw), agent)
    if mark is not None:
        _, port, _ = mark
        assert 0 <= port < 65536


def test_bad_numbers_in_a_mark_are_ignored() -> None:
    env = {SHARD_ENV: "s-0", AGENT_ENV: "a", "LLMGW_PORT": "²", "LLMGW_GPUS": "0,x,²,3"}
    assert read_mark(env, "a") == ("s-0", 0, (0, 3))
    assert read_mark({**env, "LLMGW_PORT": "70000"}, "a") == ("s-0", 0, (0, 3))


@pytest.fixture
def groups() -> Iterator[list[int]]:
    """Process groups to kill when the test ends, pass or fail."""
    started: list[int] = []
    yield started
    for pgid in started:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def spawn(env: dict[str, str], code: str, groups: list[int]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )
    groups.append(proc.pid)
    return proc


SLEEP = "import time\nwhile True: time.sleep(1)"
# A child of its own in the same group, marked by inheritance, like vLLM's workers.
WITH_CHILD = (
    "import subprocess, sys, time\n"
    f"subprocess.Popen([sys.executable, '-c', {SLEEP!r}])\n"
    "while True: time.sleep(1)"
)
DEAF = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + SLEEP


async def test_marked_engines_are_found_and_stopped_by_group(groups: list[int]) -> None:
    agent = "/tmp/state-of-this-test"
    engine = spawn(marks("m.p.1-0", agent, 20123, [1, 2]), WITH_CHILD, groups)
    stranger = spawn(marks("m.p.2-0", agent + "-other", 20124, []), SLEEP, groups)
    unmarked = spawn({}, SLEEP, groups)

    async def both() -> list[int] | None:
        found = marked_processes(agent)
        return sorted(m.pid for m in found) if len(found) == 2 else None

    pids = await wait_for_async(both, timeout=30, what="the engine and its child, marked")
    assert engine.pid in pids
    found = marked_processes(agent)
    assert {(m.pgid, m.shard_id, m.port, m.gpus) for m in found} == {
        (engine.pid, "m.p.1-0", 20123, (1, 2))
    }
    # Another agent's engine and unmarked processes are not this agent's.
    assert stranger.pid not in pids
    assert unmarked.pid not in pids

    assert await stop_group(engine.pid, found, grace=30.0)  # went on SIGTERM
    assert engine.wait(timeout=30) == -signal.SIGTERM
    assert marked_processes(agent) == []
    assert stranger.poll() is None
    assert unmarked.poll() is None


async def test_an_engine_deaf_to_sigterm_is_killed_after_the_grace(groups: list[int]) -> None:
    agent = "/tmp/state-of-another-test"
    deaf = spawn(marks("m.p.3-0", agent, 20125, []), DEAF, groups)

    async def marked() -> bool:
        # Marked from exec on; ready once Python set its handler (reads its own stat).
        return bool(marked_processes(agent)) and _ignores_term(deaf.pid)

    await wait_for_async(marked, timeout=30, what="the deaf engine, marked")
    found = marked_processes(agent)
    assert await stop_group(deaf.pid, found, grace=0.5)
    assert deaf.wait(timeout=30) == -signal.SIGKILL  # SIGTERM was ignored
    assert process_start_ticks(deaf.pid) is None


def _ignores_term(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False
