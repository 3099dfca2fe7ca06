"""TLS on one side only (issue 29 point 8): both the agent and the control plane say
"TLS mismatch", each naming what to change, instead of a reset on one side and a
handshake error (or nothing) on the other. Real processes, real sockets."""

from __future__ import annotations

from pathlib import Path

from llmgw_testkit.cluster import Cluster


def test_plaintext_agent_against_a_tls_control_plane(tmp_path: Path) -> None:
    with Cluster(tmp_path) as cluster:
        control = cluster.start_control([])
        agent = cluster.start_agent(
            "gpu-a",
            gpus=1,
            control={"address": f"127.0.0.1:{cluster.grpc_port}", "tls": {"insecure": True}},
        )
        agent.wait_output("TLS mismatch: the control plane at 127.0.0.1:", timeout=60)
        assert "serves TLS and this side connects in plaintext" in agent.output()
        control.wait_output("TLS mismatch: a plaintext client", timeout=60)


def test_tls_agent_against_a_plaintext_control_plane(tmp_path: Path) -> None:
    with Cluster(tmp_path, insecure=True) as cluster:
        control = cluster.start_control([])
        cluster.make_certs()
        agent = cluster.start_agent(
            "gpu-a",
            gpus=1,
            control={
                "address": f"127.0.0.1:{cluster.grpc_port}",
                "tls": cluster.node_cert("gpu-a"),
            },
        )
        agent.wait_output("TLS mismatch: this side connects with TLS", timeout=60)
        assert "serves plaintext" in agent.output()
        control.wait_output("TLS mismatch: a TLS client", timeout=60)
