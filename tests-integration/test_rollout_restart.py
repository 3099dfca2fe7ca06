"""Issue 17.1: a rollout survives a control-plane restart (SIGKILL, same state store).

Real control plane (its default SQLite store under a state_dir), two agents whose
simulated vLLM engines start through the real adapters, a router, and the official
openai client sending requests throughout. An engine_args change rolls across the
replicas; once at least one has been replaced, and with old ones still to go, the
control plane is killed with SIGKILL and started again on the same state_dir. The
restarted one must take the rollout up where it was: the replicas already new kept,
no replica started or drained twice, never more than ``max_surge`` extra, never fewer
than the wanted count ready at the router, no engine of a replica restarted, and not a
request failed; the rollout ends with every replica on the new revision.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from llmgw_testkit import wait_for
from llmgw_testkit.cluster import Cluster, vllm_profile
from llmgw_testkit.traffic import traffic

WANTED = 4
MAX_SURGE = 1
NEW_ARGS = ["--max-model-len", "4096"]


def models(args: list[str]) -> list[dict[str, Any]]:
    # Engines load for 2 s: a step of the rollout is long enough to kill the control
    # plane inside it, whatever the machine's load.
    profile = vllm_profile(
        replicas=WANTED,
        args=args,
        env={"LLMGW_SIM_LOAD_TIME": "2"},
        rollout={"max_surge": MAX_SURGE, "max_unavailable": 0},
    )
    return [{"name": "chat", "profiles": {"default": profile}}]


def router_view(cluster: Cluster) -> tuple[int, int]:
    """Endpoints the router would send a request to now, and its snapshot version."""
    url = f"http://127.0.0.1:{cluster.router_admin_port}/v1/endpoints"
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.loads(resp.read())
    return sum(1 for ep in body["endpoints"] if ep["state"] == "ready"), int(body["version"])


def router_ready(cluster: Cluster) -> int:
    return router_view(cluster)[0]


class Watch:
    """Samples the router's endpoints and, when it answers, the control plane's status.

    Keeps the fewest endpoints the router had ready, the most replicas (not draining)
    the control plane had at once, every replica id seen, and every engine pid seen
    per replica.
    """

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.fewest_ready = 10**6
        self.router_samples = 0
        # (seconds since start, endpoints ready, snapshot version) at every change.
        self.changes: list[tuple[float, int, int]] = []
        self.started = time.monotonic()
        self.most_live = 0
        self.status_samples = 0
        self.seen: set[str] = set()
        self.drained: set[str] = set()
        self.pids: dict[str, set[int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                ready, version = router_view(self.cluster)
            except OSError:
                pass
            else:
                if not self.changes or self.changes[-1][1:] != (ready, version):
                    self.changes.append((time.monotonic() - self.started, ready, version))
                self.fewest_ready = min(self.fewest_ready, ready)
                self.router_samples += 1
            try:
                replicas = self.cluster.replicas("chat")
            except (OSError, ValueError):
                continue  # the control plane is down (or just coming up)
            self.status_samples += 1
            live = [r for r in replicas if r["state"] != "draining"]
            self.most_live = max(self.most_live, len(live))
            for r in replicas:
                self.seen.add(r["replica_id"])
                if r["state"] == "draining":
                    self.drained.add(r["replica_id"])
                got = {s["pid"] for s in r["shards"] if s["pid"]}
                self.pids.setdefault(r["replica_id"], set()).update(got)


def rollout(cluster: Cluster) -> dict[str, Any] | None:
    found = [r for r in cluster.status().get("rollouts", []) if r["model"] == "chat"]
    return found[0] if found else None


def test_a_rollout_goes_on_after_the_control_plane_is_killed(cluster: Cluster) -> None:
    cluster.start_control(models([]))
    cluster.start_agent("gpu-a", gpus=3)
    cluster.start_agent("gpu-b", gpus=3)
    cluster.start_router(balancer="least_outstanding")
    before = {r["replica_id"] for r in cluster.wait_replicas("chat", WANTED, timeout=120)}
    cluster.wait_router_models("chat")
    wait_for(lambda: router_ready(cluster) == WANTED, timeout=60, what="4 endpoints at the router")

    results: list[str] = []
    with traffic(cluster, results, workers=3), Watch(cluster) as watch:
        wait_for(lambda: len(results) >= 10, timeout=60, what="traffic flowing")
        # The changed profile, as an operator would roll it out: edit, SIGHUP.
        path = cluster.workdir / "control.yaml"
        config = json.loads(path.read_text())
        config["models"] = models(NEW_ARGS)
        path.write_text(json.dumps(config, indent=2))
        assert cluster.control is not None
        cluster.control.signal(signal.SIGHUP)

        def one_replaced() -> list[dict[str, Any]] | None:
            replicas = cluster.replicas("chat")
            new_ready = [
                r for r in replicas if r["replica_id"] not in before and r["state"] == "ready"
            ]
            old_left = [
                r for r in replicas if r["replica_id"] in before and r["state"] != "draining"
            ]
            # At least one replaced, at least two old ones still to go.
            return replicas if new_ready and 2 <= len(old_left) < WANTED else None

        at_kill = wait_for(one_replaced, timeout=120, interval=0.02, what="one replica replaced")
        cluster.control.stop(signal.SIGKILL)
        killed_at = time.monotonic() - watch.started
        new_at_kill = {
            r["replica_id"]
            for r in at_kill
            if r["replica_id"] not in before and r["state"] == "ready"
        }
        old_at_kill = {
            r["replica_id"]
            for r in at_kill
            if r["replica_id"] in before and r["state"] != "draining"
        }
        served_down = len(results)

        cluster.start_control(models(NEW_ARGS))
        restarted_at = time.monotonic() - watch.started
        # It goes on from where it was: the replicas new at the kill count as done.
        resumed = wait_for(lambda: rollout(cluster), timeout=60, what="the rollout resumed")

        def done() -> list[dict[str, Any]] | None:
            replicas = cluster.replicas("chat")
            live = [r for r in replicas if r["state"] != "draining"]
            finished = (
                len(live) == WANTED
                and all(r["state"] == "ready" for r in live)
                and not {r["replica_id"] for r in live} & before
                and rollout(cluster) is None
            )
            return live if finished else None

        final = wait_for(done, timeout=300, what="the rollout finished after the restart")
        more = len(results)
        wait_for(lambda: len(results) >= more + 20, timeout=60, what="traffic after the rollout")

    failures = [r for r in results if r != "ok"]
    assert failures == [], failures[:5]
    assert len(results) > served_down, "requests were served across the restart"
    assert watch.router_samples > 0
    assert watch.status_samples > 0
    assert watch.fewest_ready >= WANTED, (
        f"only {watch.fewest_ready} ready at the router once: {watch.changes}"
        f" killed {killed_at:.2f} up {restarted_at:.2f}"
    )
    assert watch.most_live <= WANTED + MAX_SURGE, f"{watch.most_live} replicas at once"
    # Each old replica replaced once, by exactly one new one: nothing started twice.
    final_ids = {r["replica_id"] for r in final}
    assert watch.seen - before == final_ids, (watch.seen - before, final_ids)
    assert watch.drained <= before, watch.drained - before
    # The replicas already new at the kill were kept and counted as done at once.
    assert new_at_kill <= final_ids, new_at_kill - final_ids
    assert resumed["updated"] >= len(new_at_kill), (resumed, new_at_kill)
    assert not old_at_kill & final_ids
    # No engine restarted: one pid per replica all along, old ones across the restart too.
    assert all(len(p) == 1 for p in watch.pids.values()), watch.pids
    assert all(watch.pids.get(rid) for rid in old_at_kill | new_at_kill)
    # Every engine serving now runs the new revision's arguments.
    for r in final:
        (pid,) = watch.pids[r["replica_id"]]
        argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        assert argv[argv.index("--max-model-len") + 1] == "4096", argv
