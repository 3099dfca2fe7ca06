"""`--sim-script-routes` and `--sim-name`: what router tests need of an engine, from the
simulator (issue 25 point 6): scripted failures and health, request counts that tell a
client that left from one that finished, and the engine's name on every answer."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from llmgw_sim.script import HANG, Script, ScriptError
from llmgw_sim.testing import start
from llmgw_testkit import wait_for

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
ARGS = ["--served-model-name", "m", "--sim-script-routes", "--sim-name", "e7"]


def test_the_next_count_requests_fail_then_it_serves(tmp_path: Path) -> None:
    with start(tmp_path, "vllm", ARGS) as sim, httpx.Client(timeout=30) as c:
        assert c.get(sim.url + "/health").headers["x-sim-name"] == "e7"
        set_to = c.post(sim.url + "/sim/script", json={"status": 503, "count": 2})
        assert set_to.json() == {"status": 503, "count": 2, "healthy": True, "itl": None}
        answers = [c.post(sim.url + "/v1/chat/completions", json=CHAT) for _ in range(3)]
        assert [a.status_code for a in answers] == [503, 503, 200]
        assert all(a.headers["x-sim-name"] == "e7" for a in answers)
        assert answers[0].json()["error"]["message"] == "Scripted failure 503"
        stats = c.get(sim.url + "/sim/stats").json()
        assert stats == {"started": 3, "completed": 1, "cancelled": 0, "in_flight": 0}
        c.post(sim.url + "/sim/script", json={"healthy": False}).raise_for_status()
        assert c.get(sim.url + "/health").status_code == 503
        c.post(sim.url + "/sim/script", json={"healthy": True}).raise_for_status()
        assert c.get(sim.url + "/health").status_code == 200


def test_a_hung_request_that_its_client_leaves_counts_as_cancelled(tmp_path: Path) -> None:
    with start(tmp_path, "vllm", ARGS) as sim, httpx.Client(timeout=30) as c:
        c.post(sim.url + "/sim/script", json={"status": HANG, "count": 1}).raise_for_status()

        async def leave() -> None:
            async with httpx.AsyncClient() as ac:
                task = asyncio.create_task(ac.post(sim.url + "/v1/chat/completions", json=CHAT))
                await asyncio.to_thread(
                    wait_for,
                    lambda: c.get(sim.url + "/sim/stats").json()["in_flight"] == 1,
                    what="the request in flight",
                )
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

        asyncio.run(leave())
        wait_for(
            lambda: (
                c.get(sim.url + "/sim/stats").json()
                == {"started": 1, "completed": 0, "cancelled": 1, "in_flight": 0}
            ),
            what="the request counted as cancelled",
        )
        assert c.post(sim.url + "/v1/chat/completions", json=CHAT).status_code == 200


def test_itl_paces_streams_from_the_next_request(tmp_path: Path) -> None:
    with start(tmp_path, "vllm", ARGS) as sim, httpx.Client(timeout=30) as c:
        assert c.post(sim.url + "/sim/script", json={"itl": 0.2}).json()["itl"] == 0.2
        body = {**CHAT, "stream": True, "max_tokens": 50}
        with c.stream("POST", sim.url + "/v1/chat/completions", json=body) as resp:
            lines = resp.iter_lines()
            first = next(lines)
            assert first.startswith("data: ")
            # Paced: the stream is still running after its first chunk.
            stats = c.get(sim.url + "/sim/stats").json()
            assert stats["in_flight"] == 1, (stats, first, list(lines))
        wait_for(lambda: c.get(sim.url + "/sim/stats").json()["in_flight"] == 0, what="left")
        c.post(sim.url + "/sim/script", json={"itl": None}).raise_for_status()
        assert c.post(sim.url + "/v1/chat/completions", json=body).status_code == 200


def test_bad_script_bodies_are_400_naming_the_field(tmp_path: Path) -> None:
    with start(tmp_path, "vllm", ARGS) as sim, httpx.Client(timeout=30) as c:
        bad = c.post(sim.url + "/sim/script", json={"status": 200})
        assert bad.status_code == 400
        assert "status must be 0 (hang) or 400-599, got 200" in bad.json()["error"]
        assert c.post(sim.url + "/sim/script", content=b"{").status_code == 400


def test_without_the_knob_there_are_no_script_routes(tmp_path: Path) -> None:
    with start(tmp_path, "vllm", ["--served-model-name", "m"]) as sim:
        assert httpx.get(sim.url + "/sim/stats").status_code == 404
        assert "x-sim-name" not in httpx.get(sim.url + "/health").headers


def test_script_examples() -> None:
    s = Script()
    assert s.next_failure() is None
    s.update({"status": 0, "count": 1})
    assert (s.next_failure(), s.next_failure()) == (HANG, None)
    for body, field in [
        ([], "JSON object"),
        ({"x": 1}, "unknown field 'x'"),
        ({"count": -1}, "count must be"),
        ({"healthy": 1}, "healthy must be"),
        ({"status": True}, "status must be an integer"),
    ]:
        with pytest.raises(ScriptError, match=field):
            s.update(body)
    assert s.state() == {"status": 0, "count": 0, "healthy": True, "itl": None}
    s.update({"itl": 0.5})
    assert s.itl == 0.5
    with pytest.raises(ScriptError, match="itl must be"):
        s.update({"itl": -1})


@given(
    st.dictionaries(
        st.sampled_from(["status", "count", "healthy", "itl", "other"]),
        st.one_of(st.integers(-5, 700), st.floats(-1, 5000), st.booleans(), st.none()),
    ),
    st.integers(0, 30),
)
def test_an_update_is_all_or_nothing_and_count_requests_fail(body: dict[str, Any], n: int) -> None:
    s = Script()
    before = s.state()
    try:
        s.update(body)
    except ScriptError:
        assert s.state() == before
        return
    after = s.state()
    assert after == {**before, **body}
    assert isinstance(after["status"], int)
    assert isinstance(after["count"], int)
    failures = [s.next_failure() for _ in range(n)]
    fail = min(n, after["count"])
    assert failures == [after["status"]] * fail + [None] * (n - fail)
