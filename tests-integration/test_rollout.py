"""Issue 17.1: a changed profile rolls across its replicas under load, without a failed request.

Real control plane, agent, simulated vLLM engines and router; the official openai client
sends requests all the while. The rollout surges one replica (max_surge 1), waits for it
to be READY, drains an old one (max_unavailable 0), and repeats; a new revision that fails
validation stops the rollout with the reason in status and explain, the old replicas
serving on.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import openai
from llmgw_testkit import wait_for
from llmgw_testkit.cluster import Cluster, bin_path, vllm_profile

WANTED = 4


class Traffic:
    """Requests through the router until stopped; every outcome counted."""

    def __init__(self, router_url: str, workers: int = 3) -> None:
        self.client = openai.OpenAI(
            base_url=f"{router_url}/v1", api_key="x", max_retries=0, timeout=60
        )
        self.ok = 0
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run) for _ in range(workers)]

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=90)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                out = self.client.completions.create(model="chat", prompt="hello", max_tokens=4)
                assert out.choices[0].text
                self.ok += 1
            except Exception as err:
                self.failed.append(repr(err))


class ReadyWatch:
    """Samples the control plane's status: the fewest ready, not draining, replicas seen."""

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
                replicas = self.cluster.replicas("chat")
            except OSError:
                continue
            ready = sum(1 for r in replicas if r["state"] == "ready")
            self.fewest = min(self.fewest, ready)


def change_profile(cluster: Cluster, **changes: Any) -> None:
    path = cluster.workdir / "control.yaml"
    config = json.loads(path.read_text())
    config["models"][0]["profiles"]["default"].update(changes)
    path.write_text(json.dumps(config, indent=2))
    assert cluster.control is not None
    cluster.control.signal(signal.SIGHUP)


def rollout(cluster: Cluster) -> dict[str, Any] | None:
    found = [r for r in cluster.status().get("rollouts", []) if r["model"] == "chat"]
    return found[0] if found else None


def test_rollout_across_four_replicas_under_load(cluster: Cluster) -> None:
    models = [{"name": "chat", "profiles": {"default": vllm_profile(replicas=WANTED)}}]
    cluster.start_control(models)
    cluster.start_agent("gpu-a", gpus=WANTED + 1)
    cluster.start_router(balancer="least_outstanding")
    before = {r["replica_id"] for r in cluster.wait_replicas("chat", WANTED, timeout=120)}
    cluster.wait_router_models("chat")

    with Traffic(cluster.router_url) as traffic, ReadyWatch(cluster) as watch:
        wait_for(lambda: traffic.ok >= 10, timeout=60, what="traffic flowing")
        change_profile(cluster, engine_args=["--max-model-len", "4096"])

        def replaced() -> bool:
            live = [r for r in cluster.replicas("chat") if r["state"] != "draining"]
            ids = {r["replica_id"] for r in live}
            return (
                len(live) == WANTED
                and not ids & before
                and all(r["state"] == "ready" for r in live)
                and rollout(cluster) is None
            )

        wait_for(replaced, timeout=240, what="every replica replaced by the new revision")
        wait_for(lambda: traffic.ok >= 40, timeout=60, what="traffic after the rollout")
    assert traffic.failed == [], traffic.failed[:5]
    assert watch.fewest >= WANTED, f"only {watch.fewest} ready at one point"
    # The new engines really run with the new arguments.
    pids = cluster.engine_pids()
    cmdlines = [Path(f"/proc/{pid}/cmdline").read_text().split("\0") for pid in pids]
    assert sum("--max-model-len" in c for c in cmdlines) >= WANTED


def test_a_failing_revision_stops_the_rollout_and_the_old_ones_serve(cluster: Cluster) -> None:
    models = [{"name": "chat", "profiles": {"default": vllm_profile(replicas=2)}}]
    cluster.start_control(models)
    cluster.start_agent("gpu-a", gpus=3)
    cluster.start_router(balancer="round_robin")
    before = {r["replica_id"] for r in cluster.wait_replicas("chat", 2, timeout=120)}
    cluster.wait_router_models("chat")

    # vLLM has no such flag: the agent refuses the profile at validation, at once.
    change_profile(cluster, engine_args=["--no-such-flag-at-all"])
    stopped = wait_for(
        lambda: (r := rollout(cluster)) is not None and r["state"] == "stopped" and r,
        timeout=90,
        what="the rollout stopped",
    )
    assert "--no-such-flag-at-all" in stopped["reason"], stopped
    ready = {r["replica_id"] for r in cluster.replicas("chat") if r["state"] == "ready"}
    assert ready == before
    with Traffic(cluster.router_url, workers=2) as traffic:
        wait_for(lambda: traffic.ok >= 20, timeout=60, what="the old replicas serving")
    assert traffic.failed == []
    explained = subprocess.run(
        [bin_path("llmgw-control"), "explain", "chat", "--admin",
         f"http://127.0.0.1:{cluster.admin_port}"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert "rollout to" in explained
    assert "stopped" in explained
    assert "--no-such-flag-at-all" in explained
