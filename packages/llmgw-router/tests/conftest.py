"""Fixtures: simulated engines (llmgw-sim) and a real `llmgw-router serve`, each its own
process, and the scripted control plane (llmgw_testkit.fake_control).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from llmgw_testkit import Proc, free_port, http_get, untimed, wait_for
from llmgw_testkit.fake_control import FakeControl

untimed.load()  # no hypothesis deadlines: tests assert no timings

ROUTER = str(Path(sys.executable).parent / "llmgw-router")
SIM = str(Path(sys.executable).parent / "llmgw-sim")


# ---------------------------------------------------------------- fixtures


@dataclass
class Upstream:
    """A simulated vLLM engine (``llmgw-sim vllm serve``) named ``id``: its name comes back
    in the ``x-sim-name`` header of every answer; ``script`` and ``stats`` are the
    simulator's ``/sim/script`` and ``/sim/stats``."""

    id: str
    port: int
    proc: Proc

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict[str, int]:
        """Inference requests started, completed, cancelled (the client left), in flight."""
        return dict(httpx.get(self.url + "/sim/stats", timeout=5).json())

    def script(self, **settings: Any) -> None:
        """The next ``count`` requests answer ``status`` (0: hang); ``healthy``; ``itl``."""
        httpx.post(self.url + "/sim/script", json=settings, timeout=5).raise_for_status()

    def entry(self, models: list[str], **extra: Any) -> dict[str, Any]:
        """This upstream as an item of the router config's `endpoints:`."""
        return {"id": self.id, "url": self.url, "models": models, **extra}


@dataclass
class Router:
    port: int
    admin_port: int
    proc: Proc
    config_path: Path
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def endpoints(self) -> dict[str, Any]:
        return dict(httpx.get(self.admin + "/v1/endpoints", timeout=5).json())

    def metrics(self) -> str:
        return httpx.get(self.admin + "/metrics", timeout=5).text


def launch_upstream(tmp_path: Path, ident: str, models: list[str], *extra: str) -> Upstream:
    """Start a simulated engine serving ``models`` without waiting for it (see
    :func:`wait_up`); ``extra``: more simulator flags (``--sim-ttft``, ``--sim-itl``, ...)."""
    port = free_port()
    argv = [SIM, "vllm", "serve", models[0], "--served-model-name", *models]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--sim-load-time", "0"]
    argv += ["--sim-name", ident, "--sim-script-routes", *extra]
    return Upstream(ident, port, Proc(argv, log_dir=tmp_path, name=f"upstream-{ident}"))


def wait_up(*ups: Upstream) -> None:
    for up in ups:
        wait_for(
            lambda up=up: http_get(up.url + "/health")[0] == 200,  # type: ignore[misc]
            timeout=30,
            what=f"upstream {up.id}",
        )


def start_upstream(tmp_path: Path, ident: str, models: list[str], *extra: str) -> Upstream:
    up = launch_upstream(tmp_path, ident, models, *extra)
    try:
        wait_up(up)
    except BaseException:
        up.proc.stop()
        raise
    return up


def start_router(
    tmp_path: Path,
    config: dict[str, Any],
    *flags: str,
    wait_ready: bool = True,
    grace: float = 15.0,
) -> Router:
    port, admin_port = free_port(), free_port()
    # One process unless a test asks for more (the `workers` fixture).
    config = {
        "listen": f"127.0.0.1:{port}",
        "admin_listen": f"127.0.0.1:{admin_port}",
        "workers": 1,
        **config,
    }
    path = tmp_path / f"router-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = [ROUTER, "serve", "--config", str(path), "--log-format", "json", *flags]
    proc = Proc(argv, log_dir=tmp_path, name="llmgw-router", grace=grace)
    router = Router(port, admin_port, proc, path)
    try:
        want = "/readyz" if wait_ready else "/healthz"
        wait_for(
            lambda: proc.alive() and http_get(router.admin + want)[0] == 200,
            timeout=30,
            what=f"router {want}",
        )
    except BaseException:
        print(proc.tail())
        proc.stop()
        raise
    return router


@pytest.fixture
def spawn_upstream(tmp_path: Path) -> Iterator[Callable[..., Upstream]]:
    """Start simulated engines: ``spawn_upstream(id, [models], *sim_flags)``; all stopped at
    the end."""
    started: list[Upstream] = []

    def spawn(ident: str, models: list[str], *extra: str) -> Upstream:
        up = start_upstream(tmp_path, ident, models, *extra)
        started.append(up)
        return up

    try:
        yield spawn
    finally:
        for up in started:
            up.proc.stop()


@pytest.fixture
def workers() -> int:
    """Router processes for `spawn_router`; `@pytest.mark.parametrize("workers", [1, 2])`."""
    return 1


@pytest.fixture
def spawn_router(tmp_path: Path, workers: int) -> Iterator[Callable[..., Router]]:
    """Start routers: ``spawn_router(config_dict, *flags, wait_ready=True)``."""
    started: list[Router] = []

    def spawn(config: dict[str, Any], *flags: str, wait_ready: bool = True) -> Router:
        config = {"workers": workers, **config}
        r = start_router(tmp_path, config, *flags, wait_ready=wait_ready)
        started.append(r)
        return r

    try:
        yield spawn
    finally:
        for r in started:
            r.proc.stop()


@pytest.fixture
def control(tmp_path: Path) -> Iterator[FakeControl]:
    """The scripted control plane (llmgw_testkit.fake_control): publish a snapshot, and it is served."""
    c = FakeControl(free_port(), tmp_path / "snapshot.json", tmp_path)
    c.start()
    try:
        yield c
    finally:
        c.stop()


@dataclass
class Engine:
    """An `llmgw-sim vllm serve` process."""

    id: str
    port: int
    proc: Proc

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def flag(self, models: str = "m1") -> str:
        return f"{self.id}={self.url}={models}"

    def running(self) -> float:
        """`vllm:num_requests_running` from the engine's own metrics."""
        for line in httpx.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line.startswith("vllm:num_requests_running{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError("no vllm:num_requests_running in the engine's metrics")


@pytest.fixture
def spawn_engines(tmp_path: Path) -> Iterator[Callable[..., list[Engine]]]:
    """Start simulated vLLM engines serving `m1`: ``spawn_engines(n, *sim_flags)``."""
    started: list[Engine] = []

    def spawn(n: int, *extra: str) -> list[Engine]:
        batch = []
        for i in range(n):
            port = free_port()
            argv = [SIM, "vllm", "serve", "m1", "--host", "127.0.0.1", "--port", str(port)]
            argv += ["--sim-load-time", "0", *extra]
            engine = Engine(
                f"sim{len(started)}", port, Proc(argv, log_dir=tmp_path, name=f"sim{i}")
            )
            started.append(engine)
            batch.append(engine)
        for engine in batch:
            wait_for(
                lambda e=engine: http_get(e.url + "/health")[0] == 200,  # type: ignore[misc]
                timeout=30,
                what=f"engine {engine.id}",
            )
        return batch

    try:
        yield spawn
    finally:
        for engine in started:
            engine.proc.stop()


def _reset(ups: list[Upstream]) -> None:
    for up in ups:
        if up.proc.alive():
            up.script(status=500, count=0, healthy=True, itl=None)


@pytest.fixture(scope="module")
def _shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Upstream], Router]]:
    tmp = tmp_path_factory.mktemp("shared")
    ups = [launch_upstream(tmp, "e1", ["m1", "m2"]), launch_upstream(tmp, "e2", ["m1"])]
    try:
        wait_up(*ups)
        e1, e2 = ups
        r = start_router(
            tmp,
            {
                "endpoints": [
                    e1.entry(["m1", "m2"], profile="fast"),
                    e2.entry(["m1"], profile="cheap"),
                ],
                "health_checks": {"interval": "200ms"},
                "max_body_bytes": 1_000_000,
            },
        )
        try:
            yield ups, r
        finally:
            r.proc.stop()
    finally:
        for up in ups:
            up.proc.stop()


@pytest.fixture
def upstreams(_shared: tuple[list[Upstream], Router]) -> Iterator[list[Upstream]]:
    """Two upstreams shared by a test module: `e1` serves `m1` and `m2`, `e2` serves `m1`.

    Scripted failures, health and pacing are undone after each test.
    """
    ups = _shared[0]
    _reset(ups)
    try:
        yield ups
    finally:
        _reset(ups)


@pytest.fixture
def router(_shared: tuple[list[Upstream], Router], upstreams: list[Upstream]) -> Router:
    """A router over `upstreams`: e1 in profile `fast`, e2 in profile `cheap`."""
    r = _shared[1]
    assert r.proc.alive(), r.proc.tail()
    wait_for(
        lambda: all(ep["state"] == "ready" for ep in r.endpoints()["endpoints"]),
        what="both endpoints ready",
    )
    return r
