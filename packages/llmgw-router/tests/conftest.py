"""Fixtures: real upstream engines and a real `llmgw-router serve`, each its own process;
the scripted control plane is llmgw_testkit.fake_control.

Run as a script, this file is a tiny OpenAI-compatible upstream (aiohttp.web) with
knobs the tests need and the simulator may not have: scripted failures, a stats
endpoint that counts cancelled requests, and its id in every answer.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# ---------------------------------------------------------------- the upstream script


def _upstream_main(argv: list[str]) -> None:
    import argparse

    from aiohttp import web

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--id", required=True)
    parser.add_argument("--model", action="append", required=True)
    parser.add_argument("--chunk-delay", type=float, default=0.0)
    parser.add_argument("--first-delay", type=float, default=0.0)
    args = parser.parse_args(argv)

    stats = {"started": 0, "completed": 0, "cancelled": 0, "in_flight": 0}
    # Scripted failures: the next `count` requests answer `status` (or hang, status 0).
    failures: dict[str, Any] = {"status": 500, "count": 0, "healthy": True, "delay": None}
    headers = {"x-upstream-id": args.id}

    def completion(model: str, chat: bool, n: int) -> dict[str, Any]:
        text = "tok " * n
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
            if chat
            else {"index": 0, "text": text, "finish_reason": "stop"}
        )
        return {
            "id": f"cmpl-{args.id}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": args.id,
            "choices": [choice],
            "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n},
        }

    def chunk(model: str, chat: bool, i: int, usage: dict[str, int] | None = None) -> bytes:
        choices: list[Any] = []
        if usage is None:
            choices = [
                {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}
                if chat
                else {"index": 0, "text": f"t{i} ", "finish_reason": None}
            ]
        body: dict[str, Any] = {
            "id": f"cmpl-{args.id}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": args.id,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    async def generate(request: web.Request) -> web.StreamResponse:
        stats["started"] += 1
        stats["in_flight"] += 1
        try:
            payload = await request.json()
            model = payload.get("model")
            if model not in args.model:
                return web.json_response(
                    {
                        "error": {
                            "message": f"model {model} not served",
                            "type": "x",
                            "param": None,
                            "code": 404,
                        }
                    },
                    status=404,
                    headers=headers,
                )
            if failures["count"] > 0:
                failures["count"] -= 1
                if failures["status"] == 0:
                    await asyncio.sleep(3600)
                return web.json_response(
                    {
                        "error": {
                            "message": "scripted failure",
                            "type": "x",
                            "param": None,
                            "code": None,
                        }
                    },
                    status=failures["status"],
                    headers=headers,
                )
            chat = request.path.endswith("chat/completions")
            n = int(payload.get("max_tokens") or 5)
            delay = failures["delay"] if failures["delay"] is not None else args.chunk_delay
            if args.first_delay:
                await asyncio.sleep(args.first_delay)
            if request.path.endswith("embeddings"):
                result = {
                    "object": "list",
                    "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2, 0.3]}],
                    "model": model,
                    "usage": {"prompt_tokens": 2, "total_tokens": 2},
                }
                stats["completed"] += 1
                return web.json_response(result, headers=headers)
            if not payload.get("stream"):
                if delay:
                    await asyncio.sleep(delay * n)
                stats["completed"] += 1
                return web.json_response(completion(model, chat, n), headers=headers)
            resp = web.StreamResponse(
                headers={
                    **headers,
                    "content-type": "text/event-stream",
                    "cache-control": "no-cache",
                }
            )
            await resp.prepare(request)
            for i in range(n):
                await resp.write(chunk(model, chat, i))
                if delay:
                    await asyncio.sleep(delay)
            if (payload.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
                await resp.write(chunk(model, chat, n, usage))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            stats["completed"] += 1
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            stats["cancelled"] += 1
            print("request cancelled", flush=True)
            raise
        finally:
            stats["in_flight"] -= 1

    async def health(request: web.Request) -> web.Response:
        return web.json_response({}, status=200 if failures["healthy"] else 503)

    async def get_stats(request: web.Request) -> web.Response:
        return web.json_response(stats)

    async def script(request: web.Request) -> web.Response:
        failures.update(await request.json())
        return web.json_response(failures)

    app = web.Application()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        app.router.add_post(path, generate)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", get_stats)
    app.router.add_post("/script", script)
    print(f"upstream {args.id} on {args.port}", flush=True)
    web.run_app(
        app,
        host="127.0.0.1",
        port=args.port,
        print=None,
        handler_cancellation=True,
        access_log=None,
    )


if __name__ == "__main__":
    _upstream_main(sys.argv[1:])
    raise SystemExit(0)

# Imported only under pytest: the upstream script starts faster without them.
import httpx  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402
from llmgw_testkit import Proc, free_port, http_get, wait_for  # noqa: E402
from llmgw_testkit.fake_control import FakeControl  # noqa: E402

ROUTER = str(Path(sys.executable).parent / "llmgw-router")
SIM = str(Path(sys.executable).parent / "llmgw-sim")


# ---------------------------------------------------------------- fixtures


@dataclass
class Upstream:
    id: str
    port: int
    proc: Proc

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict[str, int]:
        return dict(httpx.get(self.url + "/stats", timeout=5).json())

    def script(self, **settings: Any) -> None:
        httpx.post(self.url + "/script", json=settings, timeout=5).raise_for_status()

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
    """Start an upstream without waiting for it (see :func:`wait_up`)."""
    port = free_port()
    argv = [sys.executable, __file__, "--port", str(port), "--id", ident, *extra]
    for model in models:
        argv += ["--model", model]
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
    """Start upstreams: ``spawn_upstream(id, [models], *flags)``; all stopped at the end."""
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
            up.script(status=500, count=0, healthy=True, delay=None)


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

    Scripted failures and delays are undone after each test.
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
