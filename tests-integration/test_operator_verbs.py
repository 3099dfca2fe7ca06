"""Issue 29 points 1-2: the operator's verbs and engine logs, on one real fleet.

One control plane (mTLS, SQLite store), two agents with simulated vLLM engines and a
router, shared by the tests of this module in order: an unauthenticated change is
refused; cordon then scale up places nothing on the cordoned node; the scale override
survives a control-plane restart; a node drained under load from the openai client
fails no request and never leaves fewer ready than wanted; ``restart`` replaces a
replica with surge, failing nothing; ``logs -f`` follows an engine's output; ``rollout
status --wait`` exits non-zero on a stopped rollout, and ``rollout undo`` brings the
fleet back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from llmgw_testkit import wait_for
from llmgw_testkit.cluster import Cluster, bin_path, vllm_profile
from llmgw_testkit.traffic import traffic

# The simulated engines log one access line per request, as vLLM's uvicorn does.
PROFILE = vllm_profile(gpus=1, replicas=2, env={"LLMGW_SIM_LOG_REQUESTS": "1"})
MODELS = [{"name": "chat", "profiles": {"default": PROFILE}}]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("operator"))
    try:
        cluster.start_control(MODELS)
        cluster.start_agent("gpu-a", gpus=3)
        cluster.start_agent("gpu-b", gpus=2)
        cluster.start_router(balancer="round_robin")
        cluster.wait_replicas("chat", 2, timeout=120)
        cluster.wait_router_models("chat")
        yield cluster
    finally:
        cluster.stop()


def token_file(cluster: Cluster) -> Path:
    return cluster.workdir / "control-state" / "admin.token"


def ctl(cluster: Cluster, *args: str, token: bool = True, timeout: float = 120) -> Any:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_ADMIN")}
    env["LLMGW_ADMIN"] = f"127.0.0.1:{cluster.admin_port}"
    if token:
        env["LLMGW_ADMIN_TOKEN_FILE"] = str(token_file(cluster))
    return subprocess.run(
        [bin_path("llmgw-control"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def ok(cluster: Cluster, *args: str, timeout: float = 120) -> str:
    done = ctl(cluster, *args, timeout=timeout)
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return str(done.stdout)


def live(cluster: Cluster) -> list[dict[str, Any]]:
    return [r for r in cluster.replicas("chat") if r["state"] != "draining"]


def ready(cluster: Cluster) -> list[dict[str, Any]]:
    return [r for r in cluster.replicas("chat") if r["state"] == "ready"]


def test_an_unauthenticated_change_is_refused(fleet: Cluster) -> None:
    assert oct(token_file(fleet).stat().st_mode & 0o777) == "0o600"
    refused = ctl(fleet, "node", "cordon", "gpu-b", token=False)
    assert refused.returncode == 1
    assert "refused (401)" in refused.stderr
    assert "Traceback" not in refused.stderr
    request = urllib.request.Request(
        f"http://127.0.0.1:{fleet.admin_port}/v1/ops/scale",
        data=json.dumps({"target": "chat", "replicas": 5}).encode(),
        headers={"Authorization": "Bearer not-the-token"},
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=10)
    assert err.value.code == 401
    assert json.loads(err.value.read())["error"] == "wrong admin token"
    # Bad input, with the token: a clear error naming what is wrong, never a 500.
    token = token_file(fleet).read_text().strip()
    for body, code, words in [
        (b"{not json", 400, "request body is not JSON"),
        (b'{"target": "chat", "replicas": "x"}', 400, "Expected `int | null`, got `str`"),
        (b'{"target": "chat", "colour": 1}', 400, "unknown field `colour`"),
        (b'{"target": "nope", "replicas": 1}', 404, "no model or model/profile 'nope'"),
    ]:
        bad = urllib.request.Request(
            f"http://127.0.0.1:{fleet.admin_port}/v1/ops/scale",
            data=body,
            headers={"Authorization": f"Bearer {token}"},
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(bad, timeout=10)
        assert err.value.code == code, body
        assert words in json.loads(err.value.read())["error"]
    # GETs stay open; nothing changed.
    status = fleet.status()
    assert status["operations"]["nodes"] == []
    assert status["operations"]["scales"] == []
    assert fleet.control is not None
    assert "admin change refused" in fleet.control.output()


def test_cordon_then_scale_up_places_nothing_on_the_cordoned_node(fleet: Cluster) -> None:
    before = {r["replica_id"] for r in live(fleet)}
    said = ok(fleet, "node", "cordon", "gpu-b")
    assert "gpu-b cordoned" in said
    assert "(by token)" in said
    node = fleet.node("gpu-b")
    assert node is not None
    assert node.get("cordoned") is True
    ok(fleet, "scale", "chat", "3")
    wait_for(lambda: len(ready(fleet)) == 3, timeout=120, what="three replicas ready")
    new = [r for r in live(fleet) if r["replica_id"] not in before]
    assert len(new) == 1
    assert new[0]["nodes"] == ["gpu-a"]
    scales = fleet.status()["operations"]["scales"]
    assert [(s["model"], s["replicas"], s["by"]) for s in scales] == [("chat", 3, "token")]
    assert fleet.control is not None
    assert "operator change" in fleet.control.output()


def test_scale_survives_a_control_plane_restart(fleet: Cluster) -> None:
    assert fleet.control is not None
    fleet.control.stop()
    fleet.start_control(MODELS)  # the config still says 2
    wait_for(lambda: len(ready(fleet)) == 3, timeout=120, what="three replicas after restart")
    status = fleet.status()
    assert [s["replicas"] for s in status["operations"]["scales"]] == [3]
    node = fleet.node("gpu-b")
    assert node is not None
    assert node.get("cordoned") is True
    # Many loop ticks later (every change of input runs a full pass; 200 ms apart), nothing
    # was drained down to the config's count.
    ticks = status["reconciles"]
    wait_for(lambda: fleet.status()["reconciles"] >= ticks + 25, timeout=60, what="ticks")
    assert len(live(fleet)) == 3
    assert all(r["state"] == "ready" for r in fleet.replicas("chat"))


class ReadyWatch:
    """The fewest ready replicas seen while it runs."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.fewest = 10**6
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def __enter__(self) -> ReadyWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.fewest = min(self.fewest, len(ready(self.cluster)))
            except OSError:
                continue


def test_drain_a_node_under_load_fails_no_request(fleet: Cluster) -> None:
    ok(fleet, "node", "uncordon", "gpu-b")
    ok(fleet, "scale", "chat", "--reset")
    wait_for(
        lambda: len(fleet.replicas("chat")) == 2 and len(ready(fleet)) == 2,
        timeout=120,
        what="back to the config's two replicas",
    )
    results: list[str] = []
    with ReadyWatch(fleet) as watch, traffic(fleet, results, workers=3):
        wait_for(lambda: len(results) >= 20, timeout=60, what="traffic flowing")
        said = ok(fleet, "node", "drain", "gpu-a", "--deadline", "3m", "--wait", timeout=300)
        assert "gpu-a: drained, 0 replica(s) left" in said
        wait_for(
            lambda: len(fleet.replicas("chat")) == 2 and len(ready(fleet)) == 2,
            timeout=120,
            what="two replicas, none draining",
        )
        served = len(results)
        wait_for(lambda: len(results) >= served + 20, timeout=60, what="traffic after the drain")
    failed = [r for r in results if r != "ok"]
    assert failed == [], failed[:5]
    assert watch.fewest >= 2
    assert all(r["nodes"] == ["gpu-b"] for r in fleet.replicas("chat"))
    drain = fleet.status()["operations"]["nodes"][0]
    assert drain["node_id"] == "gpu-a"
    assert drain["drain"]["state"] == "drained"


def test_restart_replaces_a_replica_with_surge(fleet: Cluster) -> None:
    ok(fleet, "node", "uncordon", "gpu-a")  # gpu-b is full: room for the surge
    old = ready(fleet)[0]["replica_id"]
    results: list[str] = []
    with ReadyWatch(fleet) as watch, traffic(fleet, results, workers=2):
        wait_for(lambda: len(results) >= 10, timeout=60, what="traffic flowing")
        said = ok(fleet, "restart", old)
        assert f"replica {old} restarting" in said
        wait_for(
            lambda: (
                old not in {r["replica_id"] for r in fleet.replicas("chat")}
                and len(ready(fleet)) == 2
            ),
            timeout=120,
            what="the replica replaced",
        )
    assert [r for r in results if r != "ok"] == []
    assert watch.fewest >= 2
    assert fleet.status()["operations"]["restarts"] == []  # done, forgotten


def test_logs_follow_a_simulated_engine(fleet: Cluster) -> None:
    replica = ready(fleet)[0]["replica_id"]
    tail = ok(fleet, "logs", replica, "--tail", "5")
    assert 0 < len(tail.splitlines()) <= 5
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_ADMIN")}
    env["LLMGW_ADMIN"] = f"127.0.0.1:{fleet.admin_port}"
    follower = subprocess.Popen(
        [bin_path("llmgw-control"), "logs", replica, "-f", "--tail", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(follower.stdout.readline, "")))  # type: ignore[union-attr]
    reader.start()
    client = openai.OpenAI(base_url=f"{fleet.router_url}/v1", api_key="x", max_retries=0)
    try:

        def followed() -> bool:
            client.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            return any('"POST /v1/chat/completions' in line for line in lines)

        wait_for(followed, timeout=60, what="a request's access line followed")
    finally:
        follower.send_signal(signal.SIGINT)
        try:
            follower.wait(timeout=30)
        except subprocess.TimeoutExpired:
            follower.kill()
            follower.wait(timeout=30)
        reader.join(timeout=30)
    # The agent's own polls are not in it; the reader went and its subscription with it.
    assert not any("GET /health" in line for line in lines)
    assert any("engine logs asked" in agent.output() for agent in fleet.agents.values())
    missing = ctl(fleet, "logs", "chat.default.nope")
    assert missing.returncode == 1
    assert "no replica 'chat.default.nope'" in missing.stderr


def test_rollout_status_wait_fails_on_a_stopped_rollout_and_undo_restores(fleet: Cluster) -> None:
    path = fleet.workdir / "control.yaml"
    config = json.loads(path.read_text())
    config["models"][0]["profiles"]["default"]["engine_args"] = ["--no-such-flag-at-all"]
    path.write_text(json.dumps(config, indent=2))
    assert fleet.control is not None
    fleet.control.signal(signal.SIGHUP)
    waited = ctl(fleet, "rollout", "status", "chat", "--wait", "--timeout", "3m", timeout=240)
    assert waited.returncode == 1, (waited.stdout, waited.stderr)
    assert "rollout of chat stopped" in waited.stderr
    assert "--no-such-flag-at-all" in waited.stdout
    said = ok(fleet, "rollout", "undo", "chat")
    assert "default back to the previous revision" in said
    done = ok(fleet, "rollout", "status", "chat", "--wait", "--timeout", "3m", timeout=240)
    assert "rollout of chat: complete" in done
    assert len(ready(fleet)) == 2
