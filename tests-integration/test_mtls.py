"""Mutual TLS on both streams, with real certificates from `llmgw-control ca`."""

from __future__ import annotations

import datetime
import shutil
import socket
import ssl
import subprocess
import urllib.request
from pathlib import Path

from llmgw_control.ca import issue
from llmgw_testkit import wait_for
from llmgw_testkit.cluster import Cluster, bin_path, metric_sum, vllm_profile


def tls_files(directory: Path, stem: str, ca: Path) -> dict[str, str]:
    return {
        "cert": str(directory / f"{stem}.crt"),
        "key": str(directory / f"{stem}.key"),
        "ca": str(ca),
    }


def server_serial(cluster: Cluster) -> int:
    """The serial number of the certificate the control plane presents right now."""
    node = cluster.certs / "node-gpu-a.crt"
    ctx = ssl.create_default_context(cafile=str(cluster.certs / "ca.crt"))
    ctx.load_cert_chain(str(node), str(cluster.certs / "node-gpu-a.key"))
    ctx.set_alpn_protocols(["h2"])
    from cryptography import x509

    with (
        socket.create_connection(("127.0.0.1", cluster.grpc_port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return int(x509.load_der_x509_certificate(der).serial_number)


def test_only_the_right_certificates_get_in(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_control([{"name": "chat", "profiles": {"default": vllm_profile(gpus=1)}}])
    ca = cluster.certs / "ca.crt"
    control_address = f"127.0.0.1:{cluster.grpc_port}"

    # A certificate from another CA.
    other = tmp_path / "other-ca"
    subprocess.run(
        [bin_path("llmgw-control"), "ca", "init", "--dir", str(other)],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [bin_path("llmgw-control"), "ca", "issue", "--dir", str(other), "--node", "stranger"],
        check=True,
        capture_output=True,
    )
    cluster.start_agent(
        "stranger",
        control={"address": control_address, "tls": tls_files(other, "node-stranger", ca)},
    )

    # An expired certificate from the right CA.
    past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=3)
    issue(
        cluster.certs,
        "node",
        "old",
        not_before=past,
        not_after=past + datetime.timedelta(days=1),
        out=tmp_path,
    )
    cluster.start_agent(
        "old", control={"address": control_address, "tls": tls_files(tmp_path, "node-old", ca)}
    )

    # A valid certificate for gpu-a, used by an agent that claims to be gpu-x.
    cluster.node_cert("gpu-a")
    cluster.start_agent(
        "gpu-x",
        control={"address": control_address, "tls": tls_files(cluster.certs, "node-gpu-a", ca)},
    )

    # And the real gpu-a, which gets in.
    cluster.start_agent("gpu-a", gpus=2)
    cluster.wait_node_state("gpu-a", "READY")
    cluster.wait_replicas("chat", 1)

    def refusals() -> dict[str, float]:
        text = cluster.metrics()
        return {
            "tls": metric_sum(text, "llmgw_control_refusals_total", stream="tls"),
            "agent": metric_sum(text, "llmgw_control_refusals_total", stream="agent"),
        }

    wait_for(
        lambda: refusals()["tls"] >= 2 and refusals()["agent"] >= 1,
        timeout=30,
        what="refusals counted",
    )
    assert [n["node_id"] for n in cluster.status()["nodes"]] == ["gpu-a"], (
        "nothing of the others got in"
    )

    assert cluster.control is not None
    log = cluster.control.output()
    assert "connection refused by TLS" in log
    assert "certificate has expired" in log
    assert "unable to get local issuer certificate" in log or "unknown ca" in log.lower()
    assert '"agent refused"' in log
    assert "'gpu-a'" in log
    assert "'gpu-x'" in log

    # No certificate at all: refused in the handshake, counted too.
    bare = ssl.create_default_context(cafile=str(ca))
    bare.set_alpn_protocols(["h2"])
    before = refusals()["tls"]
    try:
        with (
            socket.create_connection(("127.0.0.1", cluster.grpc_port), timeout=5) as raw,
            bare.wrap_socket(raw, server_hostname="localhost") as tls,
        ):
            tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            tls.recv(1)
    except (ssl.SSLError, OSError):
        pass
    wait_for(
        lambda: refusals()["tls"] > before, timeout=30, what="the certificate-less client refused"
    )


def test_router_needs_a_router_certificate(cluster: Cluster) -> None:
    cluster.start_control([{"name": "chat", "profiles": {"default": vllm_profile(gpus=1)}}])
    cluster.start_agent("gpu-a", gpus=1)
    cluster.wait_replicas("chat", 1)
    # A router that presents a node's certificate.
    node_tls = cluster.node_cert("gpu-a")
    cluster.start_router(
        control={
            "address": f"127.0.0.1:{cluster.grpc_port}",
            "router_id": "sneaky",
            "tls": node_tls,
        }
    )
    wait_for(
        lambda: metric_sum(cluster.metrics(), "llmgw_control_refusals_total", stream="watch") >= 1,
        timeout=30,
        what="the watch refused",
    )
    assert cluster.router_models() == set()
    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{cluster.router_admin_port}/readyz", timeout=5
        ) as r:
            status = r.status
    except urllib.error.HTTPError as err:
        status = err.code
    assert status == 503
    assert cluster.control is not None
    assert "watch refused" in cluster.control.output()


def test_rotated_server_certificate_is_picked_up_without_dropping_streams(cluster: Cluster) -> None:
    cluster.start_control([])
    cluster.start_agent("gpu-a", gpus=1)
    session = cluster.wait_node_state("gpu-a", "READY")["registered"]
    first = server_serial(cluster)

    # Rotate in place, the way an operator or cert-manager would: new files, same paths.
    staging = cluster.workdir / "staging"
    subprocess.run(
        [
            bin_path("llmgw-control"),
            "ca",
            "issue",
            "--dir",
            str(cluster.certs),
            "--server",
            "localhost,127.0.0.1",
            "--out",
            str(staging),
        ],
        check=True,
        capture_output=True,
    )
    for suffix in (".crt", ".key"):
        shutil.copy(
            staging / f"server-localhost{suffix}", cluster.certs / f"server-localhost{suffix}"
        )

    wait_for(lambda: server_serial(cluster) != first, timeout=30, what="the new certificate in use")
    assert cluster.control is not None
    assert "certificates reloaded" in cluster.control.output()
    # The agent's stream was never dropped: same registration, still READY.
    node = cluster.node("gpu-a")
    assert node is not None
    assert node["state"] == "READY"
    assert node["registered"] == session
