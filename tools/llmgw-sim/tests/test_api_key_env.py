"""The engines' API key from the environment (issue 24.3): the agent gives each engine
its secret in VLLM_API_KEY / LLAMA_API_KEY, out of the command line; the stand-ins read
it there as the real engines do, and refuse requests without it the same way."""

from __future__ import annotations

from pathlib import Path

import httpx
from llmgw_sim.testing import start

KEY = "from-the-env"
AUTH = {"Authorization": f"Bearer {KEY}"}


def test_vllm_reads_its_key_from_vllm_api_key(tmp_path: Path) -> None:
    with start(tmp_path, "vllm", ["--served-model-name", "m"], env={"VLLM_API_KEY": KEY}) as sim:
        refused = httpx.get(sim.url + "/v1/models")
        assert refused.status_code == 401
        assert refused.json() == {"error": "Unauthorized"}  # vLLM's own body
        assert httpx.get(sim.url + "/v1/models", headers=AUTH).status_code == 200
        # vLLM's key guards /v1/* only: the agent's health and metrics polls pass.
        assert httpx.get(sim.url + "/health").status_code == 200
        assert httpx.get(sim.url + "/metrics").status_code == 200


def test_vllm_api_key_flag_wins_over_the_environment(tmp_path: Path) -> None:
    args = ["--served-model-name", "m", "--api-key", "flag"]
    with start(tmp_path, "vllm", args, env={"VLLM_API_KEY": KEY}) as sim:
        assert httpx.get(sim.url + "/v1/models", headers=AUTH).status_code == 401
        ok = httpx.get(sim.url + "/v1/models", headers={"Authorization": "Bearer flag"})
        assert ok.status_code == 200


def test_llama_server_reads_its_key_from_llama_api_key(tmp_path: Path) -> None:
    args = ["-m", "/models/tiny.gguf", "--alias", "tiny", "--metrics"]
    with start(tmp_path, "llama-server", args, env={"LLAMA_API_KEY": KEY}) as sim:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        refused = httpx.post(sim.url + "/v1/chat/completions", json=body)
        assert refused.status_code == 401
        assert refused.json()["error"]["message"] == "Invalid API Key"
        served = httpx.post(sim.url + "/v1/chat/completions", json=body, headers=AUTH)
        assert served.status_code == 200
        # llama-server guards /metrics too; /health stays public.
        assert httpx.get(sim.url + "/metrics").status_code == 401
        assert httpx.get(sim.url + "/metrics", headers=AUTH).status_code == 200
        assert httpx.get(sim.url + "/health").status_code == 200


def test_llmgw_sim_open_takes_no_key_whatever_the_environment_and_flag_say(
    tmp_path: Path,
) -> None:
    """bench_routing's control fleet: the agent keys each engine, the peer routers cannot
    know those keys; LLMGW_SIM_OPEN=1 leaves the simulated vLLM open."""
    args = ["--served-model-name", "m", "--api-key", "flag"]
    env = {"VLLM_API_KEY": KEY, "LLMGW_SIM_OPEN": "1"}
    with start(tmp_path, "vllm", args, env=env) as sim:
        assert httpx.get(sim.url + "/v1/models").status_code == 200
