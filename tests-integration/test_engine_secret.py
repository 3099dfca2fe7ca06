"""Issue 24.3: engines are reachable only through the router.

Each engine the agent launches requires a fresh secret on its own port: a request sent
straight to the engine is refused (401, the engine's own body), the same request through
the router is served. The router sends the engine's secret, never the client's key; the
secret shows in no command line, status output, router listing or log.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import openai
from llmgw_testkit import wait_for
from llmgw_testkit.cluster import Cluster, vllm_profile

CLIENT_KEY = "client-key-of-the-router"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").partition("=")[::2] for e in raw if b"=" in e)


def _router_endpoints(cluster: Cluster) -> dict[str, Any]:
    url = f"http://127.0.0.1:{cluster.router_admin_port}/v1/endpoints"
    with urllib.request.urlopen(url, timeout=5) as resp:
        result: dict[str, Any] = json.loads(resp.read())
    return result


def test_direct_requests_are_refused_and_routed_ones_served(
    cluster: Cluster, tmp_path: Path
) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    llama = {
        "engine": "llamacpp",
        "model_ref": str(gguf),
        "gpus_per_node": 0,
        "replicas": 1,
        "load_timeout": "60s",
        "env": {"LLMGW_SIM_ITL": "0.005", "LLMGW_SIM_LOAD_TIME": "0.3"},
    }
    cluster.start_control(
        [
            {"name": "chat", "profiles": {"default": vllm_profile(gpus=1)}},
            {"name": "tiny", "profiles": {"default": llama}},
        ]
    )
    cluster.start_agent("gpu-a", gpus=2)
    cluster.start_router(api_keys=[CLIENT_KEY])

    def router_serves_both() -> bool:
        models = httpx.get(
            f"{cluster.router_url}/v1/models",
            headers={"Authorization": f"Bearer {CLIENT_KEY}"},
            timeout=5,
        )
        return models.status_code == 200 and {"chat", "tiny"} <= {
            m["id"] for m in models.json()["data"]
        }

    wait_for(router_serves_both, timeout=120, what="the router serving chat and tiny")

    secrets: list[str] = []
    for model, env_name in (("chat", "VLLM_API_KEY"), ("tiny", "LLAMA_API_KEY")):
        (replica,) = cluster.wait_replicas(model, 1)
        (shard,) = replica["shards"]
        url = replica["endpoint"]
        # The engine binds the advertised address (the endpoint URL's), not 0.0.0.0.
        cmdline = Path(f"/proc/{shard['pid']}/cmdline").read_bytes().split(b"\0")
        assert cmdline[cmdline.index(b"--host") + 1] == b"127.0.0.1"
        secret = _environ(shard["pid"])[env_name]
        assert len(secret) >= 32
        assert secret.encode() not in b" ".join(cmdline)  # ps shows no secret
        secrets.append(secret)

        body = {"model": model, **CHAT}
        direct = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        assert direct.status_code == 401, direct.text
        # Not with the router's client key either: only the engine's own secret opens it.
        with_client_key = httpx.post(
            f"{url}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {CLIENT_KEY}"},
            timeout=30,
        )
        assert with_client_key.status_code == 401
        if model == "chat":
            assert direct.json() == {"error": "Unauthorized"}  # vLLM's own refusal
        else:
            assert direct.json()["error"]["message"] == "Invalid API Key"  # llama-server's

        client = openai.OpenAI(
            base_url=f"{cluster.router_url}/v1", api_key=CLIENT_KEY, max_retries=0, timeout=30
        )
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
        assert reply.usage is not None
        assert reply.usage.completion_tokens == 3

    # llama-server guards /metrics too: the agent's polls carry the secret, so its load
    # still reaches the router.
    def tiny_load() -> dict[str, Any] | None:
        for ep in _router_endpoints(cluster)["endpoints"]:
            if "tiny" in ep["models"] and ep["engine"] is not None:
                return dict(ep["engine"])
        return None

    wait_for(tiny_load, timeout=60, what="the llama-server engine's load at the router")

    # Shown nowhere: control status, the router's listing, the programs' logs.
    shown = json.dumps(cluster.status()) + json.dumps(_router_endpoints(cluster))
    logs = b"".join(p.read_bytes() for p in cluster.logs.glob("*") if p.is_file())
    for secret in secrets:
        assert secret not in shown
        assert secret.encode() not in logs
