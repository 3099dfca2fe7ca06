"""Issue 27: keys and budget usage through a failover (two control planes on one etcd).

The leader counts a router's usage reports; it is SIGKILLed; the standby takes the lead
and has the key and the budget's usage as the store held them: the report the router
sends again (its reply lost with the dead leader) is not counted twice, the next one is
counted, and the standby refused both calls while it stood by.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpclib.client
import pytest
from grpclib.exceptions import GRPCError
from llmgw_proto import v1
from llmgw_testkit import Proc, free_port, wait_for
from llmgw_testkit.cluster import Cluster, bin_path, metric_sum
from llmgw_testkit.servers import Etcd


class Instance:
    def __init__(self, cluster: Cluster, name: str, etcd: Etcd) -> None:
        self.cluster = cluster
        self.name = name
        self.etcd = etcd
        self.grpc_port = free_port()
        self.admin_port = free_port()
        self.proc: Proc | None = None

    def start(self) -> None:
        config = self.cluster.control_config([])
        config["listen"] = f"127.0.0.1:{self.grpc_port}"
        config["admin_listen"] = f"127.0.0.1:{self.admin_port}"
        config["state"] = {"backend": "etcd", "etcd": {"endpoints": [self.etcd.endpoint]}}
        config["ha"] = {
            "backend": "etcd",
            "instance_id": self.name,
            "advertise": f"127.0.0.1:{self.grpc_port}",
            "lease_ttl": "3s",
        }
        # One admin token for both, made by the test (a given token_file is not made).
        config["admin_auth"] = {"token_file": str(self.cluster.workdir / "admin.token")}
        path = self.cluster.write(f"control-{self.name}.yaml", config)
        argv = [bin_path("llmgw-control"), "serve", "--config", str(path), "--log-format", "json"]
        self.proc = self.cluster._start(f"control-{self.name}", argv)
        wait_for(lambda: self.metrics() is not None, timeout=60, what=f"{self.name} admin up")

    def metrics(self) -> str | None:
        if self.proc is not None and not self.proc.alive():
            raise AssertionError(f"control {self.name} exited:\n{self.proc.tail()}")
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.admin_port}/metrics", timeout=5
            ) as resp:
                return str(resp.read().decode())
        except OSError:
            return None

    def leads(self) -> bool:
        text = self.metrics()
        return text is not None and metric_sum(text, "llmgw_control_leader") == 1

    def admin(self, path: str, body: dict[str, Any] | None = None) -> Any:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.admin_port}{path}",
            data=None if body is None else json.dumps(body).encode(),
        )
        token = (self.cluster.workdir / "admin.token").read_text().strip()
        request.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, timeout=10) as resp:
            return json.loads(resp.read())


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Instance, Instance]]:
    etcd = Etcd(tmp_path / "etcd")
    cluster = Cluster(tmp_path / "fleet", insecure=True)
    token = cluster.workdir / "admin.token"
    token.parent.mkdir(parents=True, exist_ok=True)
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    try:
        a, b = Instance(cluster, "a", etcd), Instance(cluster, "b", etcd)
        a.start()
        wait_for(a.leads, timeout=30, what="a leads")
        b.start()
        wait_for(lambda: b.metrics() is not None and not b.leads(), timeout=30, what="b stands by")
        yield a, b
    finally:
        cluster.stop()
        etcd.stop()


def report(port: int, seq: int, tokens: int) -> v1.UsageReply:
    async def call() -> v1.UsageReply:
        channel = grpclib.client.Channel("127.0.0.1", port)
        try:
            return await v1.EndpointServiceStub(channel).report_usage(
                v1.UsageReport(
                    router_id="r1",
                    instance="r1-process",
                    sequence=seq,
                    usage=[v1.KeyUsage(key="team", requests=1, prompt_tokens=tokens)],
                ),
                timeout=20,
            )
        finally:
            channel.close()

    return asyncio.run(call())


def used(reply: v1.UsageReply) -> int:
    return next(s.budget_used for s in reply.shares if s.key == "team")


def test_a_failover_keeps_keys_and_counts_each_report_once(
    pair: tuple[Instance, Instance],
) -> None:
    a, b = pair
    made = a.admin("/v1/keys", {"name": "team", "budget_tokens": 1000, "budget_period": "day"})
    assert made["secret"].startswith(made["key"]["prefix"] + "_")
    assert used(report(a.grpc_port, 1, 100)) == 100
    assert used(report(a.grpc_port, 2, 100)) == 200
    # The standby serves neither call: it names the leader.
    with pytest.raises(GRPCError, match=f"the leader is 127.0.0.1:{a.grpc_port}"):
        report(b.grpc_port, 3, 100)

    assert a.proc is not None
    a.proc.popen.send_signal(signal.SIGKILL)
    wait_for(b.leads, timeout=60, what="b leads")
    # Report 2 again (as if its reply were lost): counted once; report 3 counted.
    assert used(report(b.grpc_port, 2, 100)) == 200
    assert used(report(b.grpc_port, 3, 100)) == 300
    keys = b.admin("/v1/keys")["keys"]
    assert [(k["name"], k["budget_used"], k["prefix"]) for k in keys] == [
        ("team", 300, made["key"]["prefix"])
    ]
