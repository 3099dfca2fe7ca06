"""SGLang's disaggregation through a real router (issue 32 point 4): simulated SGLang engines
(``llmgw-sim sglang``) in ``--disaggregation-mode prefill|decode`` speak the bootstrap-room
protocol (llmgw_sim.bootstrap): the router sends the request with ``bootstrap_host``,
``bootstrap_port`` and a random ``bootstrap_room`` to a prefill and a decode engine at once;
the decode engine takes the KV of a room the prefill engine announced and refuses one no
prefill engine announced; a failed prefill makes the router retry the pair (another
prefill engine, a fresh room) and the client still gets its answer.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from llmgw_testkit import Proc, free_port, http_get, wait_for

SIM = str(Path(sys.executable).parent / "llmgw-sim")
MESSAGES = [{"role": "user", "content": "Name three lighthouses of the Atlantic coast."}]


class Sim:
    def __init__(self, tmp: Path, ident: str, mode: str) -> None:
        self.id, self.port = ident, free_port()
        self.kv_port = free_port() if mode == "prefill" else 0
        argv = [SIM, "sglang", "--model-path", "m", "--host", "127.0.0.1",
                "--port", str(self.port), "--disaggregation-mode", mode,
                "--sim-load-time", "0", "--sim-name", ident, "--sim-script-routes",
                "--sim-bootstrap-timeout", "1"]  # fmt: skip
        if self.kv_port:
            argv += ["--disaggregation-bootstrap-port", str(self.kv_port)]
        self.proc = Proc(argv, log_dir=tmp, name=f"sglang-{ident}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kv(self) -> dict[str, int]:
        return dict(httpx.get(self.url + "/sim/kv", timeout=5).json())

    def started(self) -> int:
        return int(httpx.get(self.url + "/sim/stats", timeout=5).json()["started"])


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Sim], list[Sim], str]]:
    tmp = tmp_path_factory.mktemp("sglang-pd")
    sims: list[Sim] = []
    router: Proc | None = None
    try:
        prefill = [Sim(tmp, f"p{i}", "prefill") for i in (1, 2)]
        sims += prefill
        decode = [Sim(tmp, f"d{i}", "decode") for i in (1, 2)]
        sims += decode
        for sim in sims:
            wait_for(
                lambda sim=sim: http_get(sim.url + "/health")[0] == 200,  # type: ignore[misc]
                timeout=60,
                what=f"simulated SGLang {sim.id}",
            )
        port, admin = free_port(), free_port()
        entries = [
            {"id": s.id, "url": s.url, "models": ["m"], "role": "prefill", "engine": "sglang",
             "kv_port": s.kv_port} for s in prefill
        ] + [
            {"id": s.id, "url": s.url, "models": ["m"], "role": "decode", "engine": "sglang"}
            for s in decode
        ]  # fmt: skip
        config = {"listen": f"127.0.0.1:{port}", "admin_listen": f"127.0.0.1:{admin}",
                  "workers": 1, "endpoints": entries}  # fmt: skip
        path = tmp / "router.yaml"
        path.write_text(yaml.safe_dump(config))
        router = Proc(
            [str(Path(sys.executable).parent / "llmgw-router"), "serve", "--config", str(path)],
            log_dir=tmp,
            name="router",
        )
        wait_for(
            lambda: http_get(f"http://127.0.0.1:{admin}/readyz")[0] == 200,
            timeout=60,
            what="router ready",
        )
        yield prefill, decode, f"http://127.0.0.1:{port}"
    finally:
        if router is not None:
            router.stop()
        for sim in sims:
            sim.proc.stop()


def chat(url: str) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions",
        json={"model": "m", "messages": MESSAGES, "max_tokens": 6},
        timeout=60,
    )


def test_both_engines_get_the_room_and_the_decode_engine_answers(
    fleet: tuple[list[Sim], list[Sim], str],
) -> None:
    prefill, decode, url = fleet
    r = chat(url)
    assert r.status_code == 200, r.text
    assert r.headers.get("x-sim-name") in {"d1", "d2"}
    assert r.json()["choices"][0]["message"]["content"]
    assert sum(s.kv()["kv_received"] for s in decode) == 1
    assert sum(s.started() for s in prefill) == 1


def test_a_room_no_prefill_engine_announced_is_refused(
    fleet: tuple[list[Sim], list[Sim], str],
) -> None:
    prefill, decode, _ = fleet
    body = {"model": "m", "messages": MESSAGES, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": prefill[0].kv_port, "bootstrap_room": 4242}  # fmt: skip
    refused = decode[0].kv()["kv_refused"]
    r = httpx.post(decode[0].url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 500
    assert "bootstrap room 4242" in r.text
    assert "no prefill engine announced it" in r.text
    assert decode[0].kv()["kv_refused"] == refused + 1
    # Without a room at all, a decode engine says what it needs.
    r = httpx.post(
        decode[0].url + "/v1/chat/completions",
        json={"model": "m", "messages": MESSAGES},
        timeout=30,
    )
    assert r.status_code == 400
    assert "bootstrap_room" in r.text


def test_a_failed_prefill_retries_the_pair(fleet: tuple[list[Sim], list[Sim], str]) -> None:
    prefill, decode, url = fleet
    received = sum(s.kv()["kv_received"] for s in decode)
    started = sum(s.started() for s in prefill)
    for sim in prefill:
        httpx.post(sim.url + "/sim/script", json={"status": 500, "count": 1}, timeout=5)
    r = chat(url)
    assert r.status_code == 200, r.text
    # Each prefill engine failed once (each pair's decode engine refused the room), then
    # a third pair was served.
    assert sum(s.started() for s in prefill) == started + 3
    assert sum(s.kv()["kv_received"] for s in decode) == received + 1
