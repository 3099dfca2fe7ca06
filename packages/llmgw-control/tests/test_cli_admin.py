"""The CLI's refusals and the admin HTTP responder, over a real socket."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from click.testing import CliRunner
from llmgw_control.admin import AdminServer
from llmgw_control.cli import main
from llmgw_control.metrics import Metrics
from llmgw_testkit import free_port


def test_serve_refuses_bad_config_with_file_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "control.yaml"
    bad.write_text("models:\n  - name: m\n    profiles: {p: {engine: vllm, nodes: 0}}\n")
    result = CliRunner().invoke(main, ["serve", "--config", str(bad)])
    assert result.exit_code == 2
    assert f"{bad}: $.models[0].profiles.p.nodes: Expected `int` >= 1" in result.output
    assert "Traceback" not in result.output

    bad.write_text("control: {lost_after: 1s, unreachable_after: 5s}\n")
    result = CliRunner().invoke(main, ["serve", "--config", str(bad)])
    assert result.exit_code == 2
    assert "$.control.lost_after: lost_after (1s) must be longer" in result.output


def test_serve_needs_certificates_unless_insecure(tmp_path: Path) -> None:
    config = tmp_path / "control.yaml"
    (tmp_path / "control.crt").write_text("x")
    config.write_text(f"tls: {{cert: '{tmp_path / 'control.crt'}'}}\n")
    result = CliRunner().invoke(main, ["serve", "--config", str(config)])
    assert result.exit_code == 2
    # llmgw_proto.tls's shared rule names the first missing field, and the path.
    assert (
        f"{config}: $.tls.key: required unless tls.insecure is true (or --insecure is given)"
        in result.output
    )
    cert, key = tmp_path / "control.crt", tmp_path / "gone.key"
    config.write_text(f"tls: {{cert: '{cert}', key: '{key}', ca: '{cert}'}}\n")
    result = CliRunner().invoke(main, ["serve", "--config", str(config)])
    assert result.exit_code == 2
    assert f"{config}: $.tls.key: no such file: {key}" in result.output


class Source:
    def status(self) -> dict[str, Any]:
        return {"nodes": [], "replicas": []}

    def summary(self) -> dict[str, Any]:
        return {"nodes": {"READY": 1}}

    def explain(self, model: str) -> dict[str, Any] | None:
        return {"model": model, "profiles": []} if model == "org/model" else None


async def request(port: int, raw: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = await reader.read()
    writer.close()
    return data


async def test_admin_routes_over_a_socket() -> None:
    metrics = Metrics()
    metrics.heartbeats.inc(3)
    admin = AdminServer(Source(), metrics.registry)
    port = free_port()
    await admin.start("127.0.0.1", port)
    try:
        ok = await request(port, b"GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n")
        assert ok.startswith(b"HTTP/1.1 200 OK\r\n")
        assert ok.endswith(b'{"nodes":[],"replicas":[]}')
        assert b"Content-Type: application/json" in ok
        explained = await request(port, b"GET /v1/explain/org%2Fmodel HTTP/1.1\r\n\r\n")
        assert explained.endswith(b'{"model":"org/model","profiles":[]}')
        missing = await request(port, b"GET /v1/explain/nope HTTP/1.1\r\n\r\n")
        assert missing.startswith(b"HTTP/1.1 404 Not Found")
        assert b"model 'nope' is not in the catalog" in missing
        scraped = await request(port, b"GET /metrics HTTP/1.1\r\n\r\n")
        assert b"llmgw_control_heartbeats_total 3.0" in scraped
        posted = await request(port, b"POST /v1/status HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
        assert posted.startswith(b"HTTP/1.1 405")
        garbage = await request(port, b"HELLO\r\n\r\n")
        assert garbage.startswith(b"HTTP/1.1 400")
        head = await request(port, b"HEAD /healthz HTTP/1.1\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert head.endswith(b"\r\n\r\n")
        assert (await request(port, b"GET /v1/summary HTTP/1.1\r\n\r\n")).endswith(
            b'{"nodes":{"READY":1}}'
        )
    finally:
        await admin.close()


def test_status_tables_read_like_kubectl() -> None:
    """Issue 18.2: headers say what they count; engines, load and short reasons show."""
    from llmgw_control.cli import render_explain, render_status

    data: dict[str, Any] = {
        "nodes": [
            {
                "node_id": "gpu-a", "state": "READY", "address": "10.0.0.1", "shards": 1,
                "labels": {"zone": "a"}, "gpus_used": 2,
                "gpus": [{"in_use": True}, {"in_use": True}] + [{"in_use": False}] * 6,
                "engines": [
                    {"kind": "vllm", "version": "0.32.0", "executable": "", "error": ""},
                    {"kind": "sglang", "version": "", "executable": "", "error": "no module"},
                ],
            }
        ],
        "replicas": [
            {
                "replica_id": "m.p.1", "model": "m", "profile": "p", "state": "ready",
                "adopted": False, "nodes": ["gpu-a"], "endpoint": "http://10.0.0.1:20000",
                "shards": [{"state": "ready"}], "failures": 0, "retry_in": 0, "last_error": "",
                "explanation": "1 of 1 nodes fit", "reason": "", "endpoint_warning": None,
                "load": {"known": True, "running": 3, "waiting": 5, "kv_cache_usage": 0.5},
            },
            {
                "replica_id": "m.p.2", "model": "m", "profile": "p", "state": "unplaced",
                "adopted": False, "nodes": [], "endpoint": None, "shards": [], "failures": 0,
                "retry_in": 0, "last_error": "", "reason": "too few free GPUs",
                "explanation": "0 of 1 nodes fit: 1 has too few free GPUs (need 8, ...)",
                "endpoint_warning": None, "load": None,
            },
        ],
        "rollouts": [
            {"model": "m", "profile": "p", "state": "stopped", "updated_ready": 0, "wanted": 2,
             "old": 2, "reason": "new replica m.p.3 failed: bad flag", "revision": "abc"},
        ],
        "scaling": [],
        "warnings": [],
        "unplaceable": [{"replica_id": "m.p.2", "explanation": "0 of 1 nodes fit: ..."}],
    }  # fmt: skip
    text = render_status(data)
    header = next(line for line in text.splitlines() if line.startswith("NODE "))
    assert "GPUS USED/TOTAL" in header
    node_row = next(line for line in text.splitlines() if line.startswith("gpu-a"))
    assert " 2/8 " in node_row
    assert "vllm 0.32.0, sglang (unusable)" in node_row
    assert "3 run, 5 wait, kv 50%" in text
    unplaced = next(line for line in text.splitlines() if line.startswith("m.p.2"))
    assert unplaced.rstrip().endswith("too few free GPUs")
    assert "new replica m.p.3 failed: bad flag" in text
    assert "UNPLACEABLE" in text
    explained = render_explain(
        "m",
        {"profiles": [{"profile": "p", "wanted": 2, "replicas": data["replicas"],
                       "summary": "wants 2, has 1: 0 of 1 nodes fit: ..."}]},
    )  # fmt: skip
    assert "m.p.2  unplaced: too few free GPUs" in explained
    assert "wants 2, has 1: 0 of 1 nodes fit" in explained
    assert "nowhere" not in explained


def test_lifecycle_metrics_are_computed_when_scraped() -> None:
    from prometheus_client import generate_latest

    metrics = Metrics()
    scaling: dict[tuple[str, str], dict[str, Any]] = {("m", "p"): {"wanted": 3}}
    rollouts: dict[tuple[str, str], dict[str, Any]] = {}
    metrics.count_lifecycle(lambda: scaling, lambda: rollouts)
    assert b'llmgw_control_wanted_replicas{model="m",profile="p"} 3.0' in generate_latest(
        metrics.registry
    )
    rollouts[("m", "p")] = {"state": "stopped", "old": 2}
    scaling[("m", "p")]["wanted"] = 4
    text = generate_latest(metrics.registry)
    assert b'llmgw_control_rollout_old_replicas{model="m",profile="p",state="stopped"} 2.0' in text
    assert b'llmgw_control_wanted_replicas{model="m",profile="p"} 4.0' in text
