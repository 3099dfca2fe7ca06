"""Load from the official openai client, and the router's endpoint count, for system tests."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import openai

from llmgw_testkit.cluster import Cluster, metric_sum

__all__ = ["EndpointWatch", "both_ready", "pids", "router_endpoints", "traffic"]


@contextmanager
def traffic(
    cluster: Cluster, results: list[str], workers: int = 2, model: str = "chat"
) -> Iterator[None]:
    """Chat completions in ``workers`` threads until the block ends; "ok" or the error each."""
    client = openai.OpenAI(
        base_url=f"{cluster.router_url}/v1", api_key="x", max_retries=0, timeout=30
    )
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                reply = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
                )
                ok = reply.usage is not None and reply.usage.completion_tokens == 4
                results.append("ok" if ok else "bad")
            except Exception as err:
                results.append(f"error: {err!r}")

    threads = [threading.Thread(target=loop) for _ in range(workers)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)


def router_endpoints(cluster: Cluster) -> float:
    return metric_sum(cluster.router_metrics(), "llmgw_router_endpoints")


class EndpointWatch:
    """Samples the router's endpoint count in the background; keeps the lowest."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(router_endpoints(self.cluster))
            except OSError:
                pass
            self._stop.wait(0.05)

    def __enter__(self) -> EndpointWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def pids(cluster: Cluster, model: str = "chat") -> dict[str, list[int]]:
    """Replica id -> engine pids of every ready replica of ``model``."""
    return {
        r["replica_id"]: [s["pid"] for s in r["shards"]]
        for r in cluster.replicas(model)
        if r["state"] == "ready"
    }


def both_ready(cluster: Cluster) -> dict[str, list[int]] | None:
    found = pids(cluster)
    return found if len(found) == 2 else None
