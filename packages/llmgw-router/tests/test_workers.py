"""`workers: N`: several router processes on one port under a supervisor.

Real processes throughout: the supervisor, its workers, upstream engines and
clients that open a new connection per request, so the kernel spreads them over
the workers' SO_REUSEPORT sockets.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from llmgw_router.config import RouterConfig
from llmgw_router.workers.merge import MetricsMerger
from llmgw_router.workers.worker import worker_count
from llmgw_testkit import free_port, port_open, wait_for
from llmgw_testkit.checks import metric

Router = Any
Upstream = Any
Spawn = Callable[..., Any]

ROUTER = str(Path(sys.executable).parent / "llmgw-router")
CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}


def per_worker(router: Router, name: str, workers: int) -> list[float]:
    text = router.metrics()
    return [metric(text, f'{name}{{worker="{i}"}}') for i in range(workers)]


def post(router: Router, body: dict[str, Any] | None = None, **kw: Any) -> httpx.Response:
    # A module-level call: a new connection each time, so the kernel picks a worker.
    return httpx.post(router.url + "/v1/chat/completions", json=body or CHAT, timeout=30, **kw)


def workers_of(router: Router) -> list[dict[str, Any]]:
    return list(httpx.get(router.admin + "/v1/workers", timeout=5).json()["workers"])


def open_streams_in_every_worker(
    router: Router, stack: contextlib.ExitStack, workers: int, tokens: int
) -> list[Any]:
    """Streams opened one by one until every worker holds at least one."""
    body = {**CHAT, "stream": True, "max_tokens": tokens}
    streams = []
    for _ in range(40):
        resp = stack.enter_context(
            httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=60)
        )
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        streams.append((resp, lines))
        flying = per_worker(router, "llmgw_router_worker_in_flight", workers)
        if (workers == 1 and len(streams) >= 2) or (workers > 1 and min(flying) >= 1):
            return streams
    raise AssertionError(f"40 streams did not reach all {workers} workers")


# ---------------------------------------------------------------- pure parts


def test_worker_count_defaults_to_the_cores_this_process_may_use() -> None:
    assert worker_count(RouterConfig()) == len(os.sched_getaffinity(0))
    assert worker_count(RouterConfig(workers=3)) == 3


def _exposition(requests: float, in_flight: float, version: float) -> str:
    return (
        "# HELP llmgw_router_requests_total r\n# TYPE llmgw_router_requests_total counter\n"
        f'llmgw_router_requests_total{{model="m1",status="200"}} {requests}\n'
        "# HELP llmgw_router_in_flight f\n# TYPE llmgw_router_in_flight gauge\n"
        f'llmgw_router_in_flight{{endpoint="e1"}} {in_flight}\n'
        "# HELP llmgw_router_snapshot_version v\n# TYPE llmgw_router_snapshot_version gauge\n"
        f"llmgw_router_snapshot_version {version}\n"
    )


REQ = ("llmgw_router_requests", "llmgw_router_requests_total", (("model", "m1"), ("status", "200")))
FLY = ("llmgw_router_in_flight", "llmgw_router_in_flight", (("endpoint", "e1"),))
VER = ("llmgw_router_snapshot_version", "llmgw_router_snapshot_version", ())


def test_merge_sums_counters_and_per_worker_gauges_and_keeps_fleet_gauges_once() -> None:
    merger = MetricsMerger()
    merged = merger.merge({10: _exposition(3, 1, 7), 11: _exposition(4, 2, 7)})
    assert merged[REQ] == 7
    assert merged[FLY] == 3
    assert merged[VER] == 7
    text = merger.render(merged).decode()
    assert 'llmgw_router_requests_total{model="m1",status="200"} 7.0' in text
    assert "# TYPE llmgw_router_requests_total counter" in text


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 50)), min_size=1, max_size=30))
def test_totals_never_go_backwards_when_workers_die(steps: list[tuple[int, int]]) -> None:
    """Scrape after scrape, with workers dying and replaced, the summed counter only grows."""
    merger = MetricsMerger()
    counts = {0: 0, 1: 0}
    pids = {0: 100, 1: 200}
    next_pid = 300
    last_total = 0.0
    for action, amount in steps:
        slot = action % 2
        if action >= 2:
            merger.retire(pids[slot])
            pids[slot], counts[slot] = next_pid, 0
            next_pid += 1
        else:
            counts[slot] += amount
        scrapes = {pids[s]: _exposition(counts[s], 0, 1) for s in (0, 1)}
        total = merger.merge(scrapes)[REQ]
        assert total >= last_total
        last_total = total


# ---------------------------------------------------------------- with processes


@pytest.mark.parametrize("workers", [2])
def test_requests_spread_over_workers_and_metrics_add_up(
    spawn_router: Spawn, upstreams: list[Upstream], workers: int
) -> None:
    e1, _ = upstreams
    router = spawn_router({"endpoints": [e1.entry(["m1"])]})
    assert len({w["pid"] for w in workers_of(router)}) == 2
    for _ in range(40):
        assert post(router).status_code == 200
    text = router.metrics()
    assert metric(text, 'llmgw_router_requests_total{endpoint="e1",model="m1",status="200"}') == 40
    assert metric(text, 'llmgw_router_request_duration_seconds_count{model="m1"}') == 40
    served = per_worker(router, "llmgw_router_worker_requests_total", 2)
    # 40 new connections all hashed to one socket would be a 1 in 2**39 event.
    assert sum(served) == 40
    assert min(served) > 0, served
    assert metric(text, 'llmgw_router_workers{state="up"}') == 2


@pytest.mark.parametrize("workers", [1, 2])
def test_client_disconnect_cancels_the_upstream_request_in_any_worker(
    spawn_router: Spawn, upstreams: list[Upstream], workers: int
) -> None:
    e1, _ = upstreams
    e1.script(itl=0.2)
    router = spawn_router({"endpoints": [e1.entry(["m1"])], "health_checks": {"enabled": False}})
    before = e1.stats()
    with contextlib.ExitStack() as stack:
        streams = open_streams_in_every_worker(router, stack, workers, tokens=200)
    # Every client left after its first chunk of 200: every engine request must end early.
    n = len(streams)
    wait_for(
        lambda: e1.stats()["cancelled"] == before["cancelled"] + n,
        timeout=20,
        what=f"{n} upstream requests cancelled",
    )
    assert e1.stats()["completed"] == before["completed"]
    series = 'llmgw_router_client_disconnects_total{model="m1"}'
    wait_for(lambda: metric(router.metrics(), series) == n, what="disconnects counted")


@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_lets_streams_finish_in_every_worker(
    spawn_router: Spawn, upstreams: list[Upstream], workers: int
) -> None:
    e1, _ = upstreams
    e1.script(itl=0.05)
    router = spawn_router({"endpoints": [e1.entry(["m1"])], "shutdown_grace": "30s"})
    try:
        with contextlib.ExitStack() as stack:
            streams = open_streams_in_every_worker(router, stack, workers, tokens=120)
            router.proc.signal(signal.SIGTERM)
            wait_for(lambda: "shutting down" in router.proc.output(), what="shutdown logged")
            wait_for(lambda: not port_open(router.port), what="listener closed")
            assert router.proc.alive()
            for _, lines in streams:
                events = [line[6:] for line in lines if line.startswith("data: ")]
                assert events[-1] == "[DONE]"
                assert not any("upstream_error" in e for e in events)
        assert router.proc.wait(timeout=30) == 0
        assert "router stopped" in router.proc.output()
    finally:
        router.proc.stop()


def _children(pid: int) -> set[int]:
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False
    ).stdout
    return {int(p) for p in out.split()}


@pytest.mark.parametrize("workers", [2])
def test_a_killed_worker_is_replaced_and_the_others_keep_serving(
    spawn_router: Spawn, upstreams: list[Upstream], workers: int
) -> None:
    e1, _ = upstreams
    router = spawn_router({"endpoints": [e1.entry(["m1"])]})
    first, second = workers_of(router)
    assert {first["pid"], second["pid"]} <= _children(router.proc.pid)
    os.kill(first["pid"], signal.SIGKILL)
    wait_for(lambda: first["pid"] not in _children(router.proc.pid), what="worker 0 gone")
    # Meanwhile the other worker takes every new connection.
    for _ in range(20):
        assert post(router).status_code == 200
    wait_for(
        lambda: (w := workers_of(router)[0])["up"] and w["pid"] not in (None, first["pid"]),
        timeout=30,
        what="worker 0 replaced",
    )
    assert workers_of(router)[1]["pid"] == second["pid"]
    assert workers_of(router)[0]["restarts"] == 1
    assert metric(router.metrics(), "llmgw_router_worker_restarts_total") == 1
    for _ in range(20):
        assert post(router).status_code == 200
    # What the dead worker answered stays in the totals.
    total = 'llmgw_router_requests_total{endpoint="e1",model="m1",status="200"}'
    assert metric(router.metrics(), total) >= 40
    assert "worker died; starting another" in router.proc.output()


@pytest.mark.parametrize("workers", [2])
def test_an_ejection_in_one_worker_reaches_the_others(
    spawn_router: Spawn, upstreams: list[Upstream], workers: int
) -> None:
    e1, e2 = upstreams
    router = spawn_router(
        {
            "endpoints": [e1.entry(["m1"]), e2.entry(["m1"])],
            "balancer": "round_robin",
            "health_checks": {"enabled": False},
            "ejection": {"consecutive_failures": 3, "base_time": "120s", "max_time": "240s"},
            "retries": {"budget_min_per_second": 100},
        }
    )
    e1.script(status=500, count=1000)
    series = 'llmgw_router_ejections_total{endpoint="e1"}'
    for _ in range(100):
        assert post(router).status_code == 200  # retried on e2
        if metric(router.metrics(), series) >= 1:
            break
    # Requests go one at a time, so one worker ejected e1 and the other did not.
    assert metric(router.metrics(), series) == 1

    def e1_states() -> list[str]:
        return list(
            next(ep for ep in router.endpoints()["endpoints"] if ep["id"] == "e1")[
                "state_by_worker"
            ]
        )

    wait_for(lambda: e1_states() == ["ejected", "ejected"], what="e1 ejected in both workers")
    hits = e1.stats()["started"]
    for _ in range(20):
        assert post(router).headers["x-sim-name"] == "e2"
    assert e1.stats()["started"] == hits
    assert metric(router.metrics(), series) == 1


@pytest.mark.parametrize("workers", [2])
def test_session_affinity_answers_the_same_in_every_worker(
    spawn_router: Spawn, upstreams: list[Upstream], workers: int
) -> None:
    e1, e2 = upstreams
    router = spawn_router(
        {"endpoints": [e1.entry(["m1"]), e2.entry(["m1"])], "balancer": "session_affinity"}
    )
    owners: dict[str, set[str]] = {}
    for i in range(60):
        session = f"session-{i % 6}"
        r = post(router, headers={"x-session-id": session})
        owners.setdefault(session, set()).add(r.headers["x-sim-name"])
    assert all(len(found) == 1 for found in owners.values()), owners
    assert min(per_worker(router, "llmgw_router_worker_requests_total", 2)) > 0


@pytest.mark.parametrize("workers", [2])
def test_sighup_reloads_the_api_keys_file_in_every_worker(
    spawn_router: Spawn, upstreams: list[Upstream], tmp_path: Path, workers: int
) -> None:
    e1, _ = upstreams
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys: [sk-one]\n")
    router = spawn_router({"endpoints": [e1.entry(["m1"])], "api_keys_file": str(keys)})
    assert post(router, headers={"authorization": "Bearer sk-two"}).status_code == 401
    keys.write_text("keys: [sk-one, sk-two]\n")
    router.proc.signal(signal.SIGHUP)
    wait_for(
        lambda: router.proc.output().count("SIGHUP: API keys reloaded") == 2,
        what="both workers reloaded",
    )
    for _ in range(20):
        assert post(router, headers={"authorization": "Bearer sk-two"}).status_code == 200
    assert min(per_worker(router, "llmgw_router_worker_requests_total", 2)) > 0
    # A broken file keeps the keys in use.
    keys.write_text("keys: [\n")
    router.proc.signal(signal.SIGHUP)
    wait_for(
        lambda: router.proc.output().count("API keys not reloaded") == 2, what="both kept keys"
    )
    assert post(router, headers={"authorization": "Bearer sk-two"}).status_code == 200
    assert router.proc.alive()


def test_workers_flag_and_field_are_checked(tmp_path: Path) -> None:
    r = subprocess.run(
        [ROUTER, "serve", "--endpoint", "e=http://127.0.0.1:1=m", "--workers", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "--workers" in r.stderr
    assert "Traceback" not in r.stderr
    cfg = tmp_path / "router.yaml"
    cfg.write_text("workers: 0\nendpoints: [{id: e, url: 'http://127.0.0.1:1', models: [m]}]\n")
    r = subprocess.run(
        [ROUTER, "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2
    assert "$.workers" in r.stderr
    assert str(cfg) in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("workers", [2])
def test_a_port_in_use_is_one_clear_error(
    spawn_router: Spawn, upstreams: list[Upstream], tmp_path: Path, workers: int
) -> None:
    e1, _ = upstreams
    router = spawn_router({"endpoints": [e1.entry(["m1"])], "workers": 1})
    argv = [ROUTER, "serve", "--workers", "2", "--listen", f"127.0.0.1:{router.port}"]
    argv += ["--admin-listen", f"127.0.0.1:{free_port()}", "--endpoint", f"e1={e1.url}=m1"]
    r = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=60,
    )
    # 2: a setting that cannot be used, as in every program and worker mode
    assert r.returncode == 2
    assert "--listen" in r.stderr
    assert "already in use" in r.stderr
    assert "Traceback" not in r.stderr
