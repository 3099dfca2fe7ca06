"""POST /v1/ops/ACTION and GET /v1/ops on a controller (no sockets): answers and refusals."""

from __future__ import annotations

import json
from typing import Any

import msgspec
from llmgw_control.admin import CHANGED_BY
from llmgw_control.cli import render_explain
from llmgw_control.config import ControlConfig, Loaded, check
from llmgw_control.controller import Controller
from llmgw_control.operate import Operations


def controller() -> Controller:
    config = msgspec.convert(
        {
            "tls": {"insecure": True},
            "models": [{"name": "m", "profiles": {"p": {"engine": "vllm", "replicas": 1}}}],
        },
        ControlConfig,
    )
    return Controller(Loaded(config, check(config, "control.yaml")))


async def post(ops: Operations, action: str, body: Any) -> tuple[int, Any]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    got = await ops.handle("POST", f"/v1/ops/{action}", raw)
    assert got is not None
    return got[0], json.loads(got[2])


async def test_a_change_is_applied_and_shown() -> None:
    c = controller()
    ops = Operations(c)
    CHANGED_BY.set("admin:alice")
    code, data = await post(ops, "scale", {"target": "m", "replicas": 3})
    assert (code, data["message"], data["by"]) == (200, "m/p scaled to 3", "admin:alice")
    spec = c.catalog.get("m", "p")
    assert spec is not None
    assert spec.replicas == 3
    assert c.config_catalog.get("m", "p") != spec  # what the config says stays apart
    got = await ops.handle("GET", "/v1/ops", b"")
    assert got is not None
    assert json.loads(got[2])["scales"][0]["by"] == "admin:alice"
    assert c.status()["operations"]["scales"][0]["replicas"] == 3
    # explain says it beside what the config says, and so does its text.
    explained = c.explain("m")
    assert explained is not None
    note = "scaled to 3 by admin:alice (the config says 1)"
    assert explained["profiles"][0]["overrides"] == [note]
    assert f"  override: {note}" in render_explain("m", explained).splitlines()


async def test_refusals() -> None:
    c = controller()
    ops = Operations(c)
    assert (await post(ops, "explode", {"target": "x"}))[0] == 404
    code, data = await post(ops, "cordon", b"{1, 2")
    assert code == 400
    assert "not JSON" in data["error"]
    code, data = await post(ops, "cordon", {})
    assert code == 400
    assert "missing required field `target`" in data["error"]
    code, data = await post(ops, "cordon", {"target": "gpu-z"})
    assert (code, data["error"]) == (404, "no node 'gpu-z' is known to the control plane")
    got = await ops.handle("DELETE", "/v1/ops/cordon", b"")
    assert got is not None
    assert got[0] == 405
    assert await ops.handle("POST", "/v1/keys", b"{}") is None  # not its path
    c.follow()  # a standby: changes go to the leader
    code, data = await post(ops, "scale", {"target": "m", "replicas": 2})
    assert code == 503
    assert "stands by" in data["error"]
