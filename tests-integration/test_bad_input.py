"""Scenario 8: bad configuration stops each program at start with the file and field named;
a running system given bad requests answers with clear errors and keeps serving."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest
from llmgw_testkit.cluster import Cluster, bin_path, vllm_profile

CASES = [
    ("llmgw-control", ["serve", "--insecure"], "listen: 127.0.0.1:1\nmodelz: []\n", "$: Object contains unknown field `modelz`"),
    ("llmgw-control", ["serve", "--insecure"], "control: {interval: soon}\n", "$.control.interval: Expected a duration"),
    (
        "llmgw-control",
        ["serve", "--insecure"],
        "models:\n  - name: chat\n",
        "$.models[0].profiles: ",
    ),
    (
        "llmgw-control",
        ["serve", "--insecure"],
        "models:\n  - name: chat\n    profiles:\n      fast: {engine: vllm, gpus_per_node: -1}\n",
        "$.models[0].profiles.fast.gpus_per_node: Expected `int` >= 0",
    ),
    ("llmgw-agent", ["run", "--insecure"], "simulate_gpus: {count: many}\n", "$.simulate_gpus.count: Expected `int`, got `str`"),
    ("llmgw-agent", ["run", "--insecure"], "labelz: {}\n", "$: Object contains unknown field `labelz`"),
    ("llmgw-router", ["serve"], "listen: 127.0.0.1:1\nbalancer: fastest\n", "$.balancer: Invalid enum value 'fastest'"),
    ("llmgw-router", ["serve"], "deadlines: {connect: 5s, first_bite: 3s}\n", "$.deadlines: Object contains unknown field `first_bite`"),
]  # fmt: skip


@pytest.mark.parametrize(("program", "args", "text", "expected"), CASES)
def test_bad_config_names_file_and_field(
    tmp_path: Path, program: str, args: list[str], text: str, expected: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    done = subprocess.run(
        [bin_path(program), *args, "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert f"{path}: {expected}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def test_no_profile_message_points_to_static_endpoints(tmp_path: Path) -> None:
    path = tmp_path / "control.yaml"
    path.write_text("models:\n  - name: chat\n")
    done = subprocess.run(
        [bin_path("llmgw-control"), "serve", "--insecure", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--endpoint" in done.stderr
    assert "Traceback" not in done.stderr


def test_running_system_answers_bad_requests_and_keeps_serving(cluster: Cluster) -> None:
    cluster.start_control([{"name": "chat", "profiles": {"default": vllm_profile(gpus=1)}}])
    cluster.start_agent("gpu-a", gpus=1)
    cluster.start_router(max_body_bytes=4096)
    cluster.wait_replicas("chat", 1)
    cluster.wait_router_models("chat")
    url = f"{cluster.router_url}/v1/chat/completions"
    with httpx.Client(timeout=30) as http:
        bad = [
            (http.post(url, content=b"{not json"), 400, None),
            (http.post(url, json={"messages": []}), 400, "model"),
            (http.post(url, json={"model": "nope", "messages": []}), 404, "model"),
            (http.post(url, json={"model": "chat", "messages": "x" * 10000}), 413, None),
            (
                http.post(
                    url,
                    json={
                        "model": "chat",
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": -3,
                    },
                ),
                400,
                None,
            ),
        ]
        for response, status, param in bad:
            assert response.status_code == status, response.text
            error = response.json()["error"]
            assert error["message"]
            assert {"message", "type", "param", "code"} <= set(error)
            if param:
                assert error["param"] == param
        good = http.post(
            url,
            json={
                "model": "chat",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
            },
        )
        assert good.status_code == 200
        assert good.json()["usage"]["completion_tokens"] == 3
    # Nothing that was accepted was lost: the replica is still the same, still ready.
    (replica,) = cluster.wait_replicas("chat", 1)
    assert replica["failures"] == 0
