"""Any failure to reach an endpoint is a connect failure, never a 500 (issue 24.7).

In-process: the upstream client, the health checker and the watcher, each given an
endpoint it cannot reach or cannot even parse. A real router against a scripted control
plane is in test_bad_endpoint_urls.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import httpx
import msgspec
import pytest
from aiohttp import web
from aiohttp.client_reqrep import ConnectionKey
from llmgw_proto.tls import TlsConfig
from llmgw_proto.v1 import Endpoint as WireEndpoint
from llmgw_proto.v1 import EndpointSnapshot
from llmgw_router.config import ControlConfig, HealthCheckConfig, RouterConfig
from llmgw_router.control.watch import EndpointWatcher, url_problem
from llmgw_router.endpoints import Endpoint, EndpointSet, EndpointSpec
from llmgw_router.health import HealthChecker
from llmgw_router.metrics import Metrics
from llmgw_router.proxy import ProxyApp
from llmgw_router.state import RouterState
from llmgw_router.upstream import ConnectError, Pool
from llmgw_testkit import free_port

BAD_URLS = [
    "http://127.0.0.1:99999",  # the review's URL: urlsplit's .port raised ValueError
    "http://:8000",  # no host: was sent to 127.0.0.1
    "http://",
    "127.0.0.1:8000",
    "ftp://127.0.0.1:21",
    "http://a..b:8000",  # the resolver's UnicodeError ("label empty")
    "http://127.0.0.1:0",
]


@pytest.mark.parametrize("url", BAD_URLS)
async def test_the_client_refuses_a_url_it_cannot_parse_as_a_connect_failure(url: str) -> None:
    pool = Pool()
    with pytest.raises(ConnectError, match="endpoint URL"):
        await pool.post(url, "/v1/completions", b"{}", [], connect_timeout=2)
    pool.close()


def connect_raising(exc: BaseException) -> Any:
    async def create_connection(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return create_connection


CONNECT_ERRORS: list[BaseException] = [
    ConnectionRefusedError(111, "Connection refused"),
    OSError(101, "Network is unreachable"),
    UnicodeError("encoding with 'idna' codec failed (label too long)"),
    ValueError("port must be 0-65535"),
    OverflowError("getsockaddrarg: port must be 0-65535."),
    RuntimeError("something else entirely"),
    aiohttp.ClientConnectorError(
        ConnectionKey("h", 1, False, True, None, None, None), OSError(1, "x")
    ),
    aiohttp.InvalidURL("http://x:y"),
]


@pytest.mark.parametrize("exc", CONNECT_ERRORS, ids=lambda e: type(e).__name__)
async def test_any_exception_opening_the_connection_is_a_connect_failure(
    exc: BaseException, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = Pool()
    loop = asyncio.get_running_loop()
    monkeypatch.setattr(loop, "create_connection", connect_raising(exc))
    with pytest.raises(ConnectError, match=f"cannot connect to 127.0.0.1:{8000}"):
        await pool.post("http://127.0.0.1:8000", "/", b"", [], connect_timeout=2)
    pool.close()


async def test_cancellation_is_not_a_connect_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = Pool()
    loop = asyncio.get_running_loop()
    monkeypatch.setattr(loop, "create_connection", connect_raising(asyncio.CancelledError()))
    with pytest.raises(asyncio.CancelledError):
        await pool.post("http://127.0.0.1:8000", "/", b"", [], connect_timeout=2)
    pool.close()


class RaisingSession:
    """A stand-in for aiohttp's session whose every GET raises ``exc``."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def get(self, *args: Any, **kwargs: Any) -> Any:
        raise self.exc


def checker(session: Any) -> tuple[HealthChecker, Endpoint]:
    cfg = RouterConfig(health_checks=HealthCheckConfig(unhealthy_threshold=1))
    ep = Endpoint(spec=EndpointSpec(id="bad", url="http://127.0.0.1:99999", models=("m",)))
    state = RouterState(cfg, EndpointSet([ep]), Metrics())
    return HealthChecker(state, session), ep


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("Port out of range 0-65535"),
        aiohttp.InvalidURL("http://127.0.0.1:99999"),
        aiohttp.ClientConnectionError("x"),
        UnicodeError("label empty or too long"),
        TimeoutError(),
    ],
    ids=lambda e: type(e).__name__,
)
async def test_a_probe_that_raises_marks_the_endpoint_unhealthy(exc: BaseException) -> None:
    """Before, a ValueError ended the health checker's task: the bad endpoint stayed ready."""
    health, ep = checker(RaisingSession(exc))
    await health._probe(ep)
    assert not ep.healthy
    assert ep.state(0.0) == "unhealthy"


async def test_a_real_probe_of_a_bad_url_marks_it_unhealthy() -> None:
    async with aiohttp.ClientSession() as session:
        health, ep = checker(session)
        await health._probe(ep)
    assert not ep.healthy


def wire(ident: str, url: str) -> WireEndpoint:
    return WireEndpoint(id=ident, url=url, served_model_names=["m"], model="m")


def test_the_watcher_ignores_unparseable_urls_and_logs_each_once(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    cc = ControlConfig(tls=TlsConfig(insecure=True))
    state = RouterState(RouterConfig(control=cc), EndpointSet([]), Metrics())
    watcher = EndpointWatcher(state, cc, insecure=True, router_id="r")
    good = f"http://127.0.0.1:{free_port()}"
    endpoints = [wire(f"bad{i}", url) for i, url in enumerate(BAD_URLS)] + [wire("ok", good)]
    for version in (1, 2, 3):
        assert watcher.apply(EndpointSnapshot(version=version, endpoints=endpoints), False)
        assert [ep.id for ep in state.endpoints.endpoints] == ["ok"]
    assert len(watcher.refused_urls) == len(BAD_URLS)
    logged = capsys.readouterr()
    # Where structlog writes depends on what configured it first: look everywhere.
    text = logged.out + logged.err + caplog.text
    for url in BAD_URLS:
        assert text.count(url_problem(url)) == 1, text


def test_url_problem_agrees_with_the_control_planes_rule() -> None:
    for url in BAD_URLS:
        assert url_problem(url).startswith(f"endpoint URL {url!r}: ")
    assert url_problem("http://127.0.0.1:8000") == ""
    assert url_problem("https://[::1]:8443") == ""


# ---------------------------------------------------------------- the proxy, in-process


class Flaky(Pool):
    """The real client, except that reaching ``bad`` raises ``exc`` (as a bug might)."""

    def __init__(self, bad: str, exc: BaseException) -> None:
        super().__init__()
        self.bad = bad
        self.exc = exc

    async def post(self, base_url: str, *args: Any, **kwargs: Any) -> Any:
        if base_url == self.bad:
            raise self.exc
        return await super().post(base_url, *args, **kwargs)


async def engine_app() -> tuple[str, Any]:
    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(
            {"id": "x", "object": "chat.completion", "model": "m", "choices": []}
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return f"http://127.0.0.1:{port}", runner


def proxy_over(urls: list[str], pool: Pool) -> tuple[ProxyApp, RouterState]:
    cfg = msgspec.convert(
        {
            "balancer": "least_outstanding",
            "retries": {"max_retries": 3},
            "ejection": {"consecutive_failures": 2},
            "health_checks": {"enabled": False},
        },
        RouterConfig,
    )
    specs = [EndpointSpec(id=f"e{i}", url=u, models=("m",)) for i, u in enumerate(urls)]
    state = RouterState(cfg, EndpointSet(Endpoint(spec=s) for s in specs), Metrics())
    return ProxyApp(state, pool), state


ODD_ERRORS: list[BaseException] = [
    RuntimeError("a bug in the client"),
    ValueError("Port out of range 0-65535"),
    AssertionError("transport is None"),
    KeyError("x"),
]


@pytest.mark.parametrize("exc", ODD_ERRORS, ids=lambda e: type(e).__name__)
async def test_the_proxy_retries_any_exception_elsewhere_and_never_answers_500(
    exc: BaseException,
) -> None:
    good, runner = await engine_app()
    bad = "http://127.0.0.1:9"
    pool = Flaky(bad, exc)
    proxy, state = proxy_over([bad, good], pool)
    try:
        transport = httpx.ASGITransport(app=proxy)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
            # The balancer picks e0 only now and then (it breaks ties on what
            # it has seen), so send until it has been tried twice and ejected.
            bad_ep = state.endpoints.by_id["e0"]
            codes: list[int] = []
            while bad_ep.outlier.ejections == 0 and len(codes) < 200:
                reply = await http.post("/v1/chat/completions", json={"model": "m"})
                codes.append(reply.status_code)
        assert codes == [200] * len(codes)
        assert bad_ep.outlier.ejections >= 1, "counted toward ejection"
        # Only the bad one left: 502, still not 500.
        proxy, _ = proxy_over([bad], Flaky(bad, exc))
        transport = httpx.ASGITransport(app=proxy)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
            reply = await http.post("/v1/chat/completions", json={"model": "m"})
        assert reply.status_code == 502
        assert reply.json()["error"]["code"] == "connect"
    finally:
        pool.close()
        await runner.cleanup()
