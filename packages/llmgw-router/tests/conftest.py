"""Fixtures: real upstream engines and a real `llmgw-router serve`, each its own process.

Run as a script, this file is a tiny OpenAI-compatible upstream (aiohttp.web) with
knobs the tests need and the simulator may not have: scripted failures, a stats
endpoint that counts cancelled requests, and its id in every answer.
"""

from __future__ import annotations

import asyncio
import datetime
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


# ---------------------------------------------------------------- the control-plane script


def _control_main(argv: list[str]) -> None:
    """A scripted control plane: serves `EndpointService` on real gRPC.

    It publishes the snapshot in ``--snapshot`` (JSON: version, endpoints, models) on
    subscribe and again whenever the file changes, streams the load figures in
    ``--loads`` (JSON: a list of EndpointLoad fields) as full updates every 100 ms while
    the file exists, prints each subscription and each demand report. With ``--leader
    ADDR`` it is a standby: every call gets UNAVAILABLE with ``llmgw-leader: ADDR``.
    """
    import argparse

    import grpclib.const
    from grpclib.server import Server, Stream
    from llmgw_proto.v1 import (
        DeclaredModel,
        DemandReply,
        DemandRequest,
        Endpoint,
        EndpointLoad,
        EndpointServiceBase,
        EndpointSnapshot,
        LoadUpdate,
        WatchRequest,
    )

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--snapshot", type=Path, required=True)
    parser.add_argument("--loads", type=Path)
    parser.add_argument("--leader")
    parser.add_argument("--tls", nargs=3, metavar=("CERT", "KEY", "CA"), type=Path)
    args = parser.parse_args(argv)

    def read() -> tuple[str, EndpointSnapshot | None]:
        try:
            text = args.snapshot.read_text()
        except FileNotFoundError:
            return "", None
        data = json.loads(text)
        return text, EndpointSnapshot(
            version=data["version"],
            endpoints=[
                Endpoint(
                    id=ep["id"],
                    url=ep["url"],
                    served_model_names=ep["models"],
                    model=ep["models"][0],
                    profile=ep.get("profile", "default"),
                    weight=ep.get("weight", 1),
                    node_id=ep.get("node_id", ""),
                    replica_id=ep.get("replica_id", ""),
                    health_path="/health",
                    generation=ep.get("generation", 0),
                )
                for ep in data["endpoints"]
            ],
            models=[
                DeclaredModel(
                    name=m["name"],
                    served_model_names=m.get("served_model_names", [m["name"]]),
                    scale_to_zero=m.get("scale_to_zero", False),
                )
                for m in data.get("models", [])
            ],
        )

    def read_loads() -> LoadUpdate | None:
        if args.loads is None:
            return None
        try:
            items = json.loads(args.loads.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return LoadUpdate(
            full=True,
            loads=[
                EndpointLoad(
                    endpoint_id=item["endpoint_id"],
                    known=item.get("known", True),
                    running=item.get("running", 0),
                    waiting=item.get("waiting", 0),
                    kv_cache_usage=item.get("kv_cache_usage", 0.0),
                    generation=item.get("generation", 0),
                    age=datetime.timedelta(seconds=item.get("age", 0.0)),
                )
                for item in items
            ],
        )

    class Scripted(EndpointServiceBase):
        async def watch(self, message: WatchRequest) -> Any:
            print(
                f"subscribed router_id={message.router_id} known_version={message.known_version}",
                flush=True,
            )
            sent = ""
            while True:
                text, snapshot = read()
                if snapshot is not None and text != sent:
                    sent = text
                    print(f"published version={snapshot.version}", flush=True)
                    yield snapshot
                await asyncio.sleep(0.05)

        async def watch_load(self, message: WatchRequest) -> Any:
            print(f"load subscribed router_id={message.router_id}", flush=True)
            while True:
                update = read_loads()
                if update is not None:
                    yield update
                await asyncio.sleep(0.1)

        async def report_demand(self, message: DemandRequest) -> DemandReply:
            print(f"demand model={message.model} held={message.held}", flush=True)
            return DemandReply(accepted=True)

    class Standby:
        """Answers every call UNAVAILABLE and names the leader in trailing metadata."""

        def __mapping__(self) -> dict[str, grpclib.const.Handler]:
            async def refuse(stream: Stream[Any, Any]) -> None:
                await stream.recv_message()
                print("refused as standby", flush=True)
                await stream.send_trailing_metadata(
                    status=grpclib.const.Status.UNAVAILABLE,
                    status_message="standby",
                    metadata={"llmgw-leader": args.leader},
                )

            real = Scripted().__mapping__()
            return {
                route: grpclib.const.Handler(refuse, h.cardinality, h.request_type, h.reply_type)
                for route, h in real.items()
            }

    async def serve() -> None:
        from llmgw_proto.tls import server_context

        server = Server([Standby() if args.leader else Scripted()])
        ssl = server_context(*args.tls) if args.tls else None
        await server.start("127.0.0.1", args.port, ssl=ssl)
        print(f"control on {args.port}", flush=True)
        await server.wait_closed()

    asyncio.run(serve())


if __name__ == "__main__":
    if sys.argv[1:2] == ["control"]:
        _control_main(sys.argv[2:])
    else:
        _upstream_main(sys.argv[1:])
    raise SystemExit(0)

# Imported only under pytest: the upstream script starts faster without them.
import httpx  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402
from llmgw_testkit import Proc, free_port, http_get, wait_for  # noqa: E402

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


@dataclass
class Control:
    """The scripted control plane: write a snapshot, and it is published."""

    port: int
    snapshot_path: Path
    tmp_path: Path
    proc: Proc | None = None
    tls: tuple[Path, Path, Path] | None = None
    # A standby: every call is refused with this leader address.
    leader: str | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def loads_path(self) -> Path:
        return self.snapshot_path.with_name(self.snapshot_path.stem + "-loads.json")

    def start(self) -> None:
        argv = [sys.executable, __file__, "control", "--port", str(self.port)]
        argv += ["--loads", str(self.loads_path)]
        if self.tls:
            argv += ["--tls", *map(str, self.tls)]
        if self.leader:
            argv += ["--leader", self.leader]
        self.proc = Proc(
            [*argv, "--snapshot", str(self.snapshot_path)], log_dir=self.tmp_path, name="control"
        )
        self.proc.wait_output(f"control on {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def publish(
        self,
        version: int,
        *ups: Upstream,
        model: str = "m1",
        models: list[dict[str, Any]] | None = None,
        generations: dict[str, int] | None = None,
    ) -> None:
        endpoints = [
            {
                "id": f"{up.id}-replica",
                "url": up.url,
                "models": [model],
                "node_id": f"node-{up.id}",
                "generation": (generations or {}).get(up.id, 0),
            }
            for up in ups
        ]
        body = {"version": version, "endpoints": endpoints, "models": models or []}
        tmp = self.snapshot_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body))
        tmp.replace(self.snapshot_path)

    def set_loads(self, loads: list[dict[str, Any]] | None) -> None:
        """Stream these EndpointLoad figures (None: stop sending any)."""
        if loads is None:
            self.loads_path.unlink(missing_ok=True)
            return
        tmp = self.loads_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(loads))
        tmp.replace(self.loads_path)

    def output(self) -> str:
        return self.proc.output() if self.proc is not None else ""


@pytest.fixture
def control(tmp_path: Path) -> Iterator[Control]:
    c = Control(free_port(), tmp_path / "snapshot.json", tmp_path)
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
