"""Dynamic endpoints over a real gRPC stream from a scripted control plane.

The control plane is written elsewhere; a small grpclib server (llmgw_testkit.fake_control,
run as its own process) serves `EndpointService.Watch` from a snapshot file instead; the
engines are simulated (llmgw-sim).
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from llmgw_testkit import wait_for

Router = Any
Upstream = Any
Control = Any
Spawn = Callable[..., Any]


def endpoint_ids(router: Router) -> set[str]:
    return {ep["id"] for ep in router.endpoints()["endpoints"]}


def watch_config(control: Control) -> dict[str, Any]:
    return {
        "control": {
            "address": control.address,
            "tls": {"insecure": True},
            "router_id": "router-under-test",
            "backoff_base": "100ms",
            "backoff_cap": "500ms",
        },
        "health_checks": {"interval": "200ms"},
    }


async def test_snapshots_drive_the_endpoint_set(
    spawn_router: Spawn, upstreams: list[Upstream], control: Control
) -> None:
    e1, e2 = upstreams
    router = await asyncio.to_thread(spawn_router, watch_config(control), wait_ready=False)
    async with httpx.AsyncClient(timeout=30) as http:
        # Subscribed, nothing published yet: alive but not ready, and no model: a 503
        # that says why (issue 13.7), not a 404 for a model that may well exist.
        await asyncio.to_thread(
            control.proc.wait_output, "subscribed router_id=router-under-test known_version=0"
        )
        assert (await http.get(router.admin + "/readyz")).status_code == 503
        r = await http.post(
            router.url + "/v1/chat/completions",
            json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "control_plane_unavailable"
        assert (
            f"no endpoint snapshot yet from the control plane at {control.address}"
            in r.json()["error"]["message"]
        )

        control.publish(1, e1)
        await asyncio.to_thread(
            wait_for,
            lambda: httpx.get(router.admin + "/readyz").status_code == 200,
            what="ready after the first snapshot",
        )
        r = await http.post(
            router.url + "/v1/chat/completions",
            json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.headers["x-sim-name"] == "e1"
        listing = (await http.get(router.admin + "/v1/endpoints")).json()
        assert listing["version"] == 1
        assert listing["endpoints"][0]["node_id"] == "node-e1"

        # A change under load: streams in flight on e1 finish there, new ones go to e2.
        for up in upstreams:
            up.script(itl=0.02)
        results: list[tuple[int, str, str]] = []

        async def one() -> None:
            body = {
                "model": "m1",
                "stream": True,
                "max_tokens": 25,
                "messages": [{"role": "user", "content": "hi"}],
            }
            async with http.stream("POST", router.url + "/v1/chat/completions", json=body) as resp:
                text = (await resp.aread()).decode()
                results.append((resp.status_code, resp.headers.get("x-sim-name", ""), text))

        async def worker() -> None:
            for _ in range(8):
                await one()

        workers = [asyncio.create_task(worker()) for _ in range(6)]
        while len(results) < 6:
            await asyncio.sleep(0.02)
            assert not all(w.done() for w in workers)
        control.publish(2, e2)
        await asyncio.to_thread(
            wait_for, lambda: endpoint_ids(router) == {"e2-replica"}, what="snapshot 2 applied"
        )
        switched_at = len(results)
        await asyncio.gather(*workers)
    assert len(results) == 48
    for status, _, text in results:
        assert status == 200
        assert text.rstrip().endswith("data: [DONE]")
        assert "upstream_error" not in text
    # Requests that started after the swap could only go to e2.
    assert {served for _, served, _ in results[switched_at + 6 :]} == {"e2"}


def test_last_snapshot_survives_the_control_plane(
    spawn_router: Spawn, upstreams: list[Upstream], control: Control
) -> None:
    e1, e2 = upstreams
    control.publish(7, e2)
    router = spawn_router(watch_config(control))
    assert endpoint_ids(router) == {"e2-replica"}

    control.stop()
    wait_for(lambda: "control plane stream lost" in router.proc.output(), what="loss noticed")
    for _ in range(5):
        r = httpx.post(
            router.url + "/v1/chat/completions",
            json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 200
        assert r.headers["x-sim-name"] == "e2"
    assert httpx.get(router.admin + "/readyz").status_code == 200

    # A restarted control plane counts from 1 again; its first snapshot still wins.
    control.publish(1, e1, e2)
    control.start()
    control.proc.wait_output("known_version=7")
    wait_for(
        lambda: endpoint_ids(router) == {"e1-replica", "e2-replica"},
        what="snapshot from the restarted control plane",
    )


def _issue_certs(directory: Path) -> dict[str, Path]:
    """A CA, a control-plane certificate for 127.0.0.1 and a router client certificate."""
    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(stem: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        (directory / f"{stem}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        (directory / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def builder(
        subject: str, issuer: str, key: ec.EllipticCurvePrivateKey
    ) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(name(issuer))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        builder("llmgw test CA", "llmgw test CA", ca_key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    write("ca", ca_key, ca)
    for stem, sans in (
        ("control", [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
        ("router", []),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        b = builder(stem, "llmgw test CA", key)
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        write(stem, key, b.sign(ca_key, hashes.SHA256()))
    return {stem: directory / stem for stem in ("ca", "control", "router")}


def test_watch_over_mutual_tls(
    tmp_path: Path, spawn_router: Spawn, upstreams: list[Upstream], control: Control
) -> None:
    certs = _issue_certs(tmp_path)
    control.stop()
    control.tls = (
        certs["control"].with_suffix(".crt"),
        certs["control"].with_suffix(".key"),
        certs["ca"].with_suffix(".crt"),
    )
    control.publish(3, upstreams[0])
    control.start()
    cfg = watch_config(control)
    cfg["control"]["tls"] = {
        "cert": str(certs["router"].with_suffix(".crt")),
        "key": str(certs["router"].with_suffix(".key")),
        "ca": str(certs["ca"].with_suffix(".crt")),
    }
    router = spawn_router(cfg)
    assert endpoint_ids(router) == {"e1-replica"}
    assert "plaintext" not in router.proc.output()
    assert '"tls": true' in router.proc.output()
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.headers["x-sim-name"] == "e1"
