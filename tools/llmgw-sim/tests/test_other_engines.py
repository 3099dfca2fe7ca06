"""The SGLang and llama.cpp stand-ins: their own health, metrics, errors and flags."""

from __future__ import annotations

from pathlib import Path

import httpx
from llmgw_sim.metrics import parse_prometheus
from llmgw_sim.testing import SIM, Sim, engine_argv, run_to_exit, start
from llmgw_testkit import Proc, free_port, http_get, wait_for
from llmgw_testkit.checks import stream_chat_with_usage


def _stream_with_usage(sim: Sim, model: str, api_key: str = "none") -> None:
    got = stream_chat_with_usage(sim.url, model, max_tokens=6, api_key=api_key)
    assert got.chunks[0].choices[0].delta.role == "assistant"
    assert len(got.pieces) == 6
    assert got.chunks[-1].usage is not None
    assert got.chunks[-1].usage.completion_tokens == 6


def test_sglang_health_is_503_while_loading(tmp_path: Path) -> None:
    port = free_port()
    loaded = tmp_path / "loaded"
    args = ["--tp-size", "2", "--sim-load-until", str(loaded)]
    with Proc(
        engine_argv("sglang", port, args), log_dir=tmp_path, env={"CUDA_VISIBLE_DEVICES": "0,1"}
    ) as proc:
        proc.wait_output("Uvicorn running on")
        assert http_get(f"http://127.0.0.1:{port}/health")[0] == 503
        loaded.touch()
        proc.wait_output("The server is fired up and ready to roll!")
        assert http_get(f"http://127.0.0.1:{port}/health")[0] == 200
        assert "Load weight begin" in proc.output()
        # Without --enable-metrics SGLang serves no /metrics.
        assert http_get(f"http://127.0.0.1:{port}/metrics")[0] == 404


def test_sglang_api_and_metrics(tmp_path: Path) -> None:
    args = ["--served-model-name", "qwen", "--enable-metrics", "--api-key", "k"]
    with start(tmp_path, "sglang", args) as sim:
        _stream_with_usage(sim, "qwen", api_key="k")
        r = httpx.get(sim.url + "/v1/models", headers={"Authorization": "Bearer k"})
        assert [m["id"] for m in r.json()["data"]] == ["qwen"]
        assert httpx.get(sim.url + "/v1/models").status_code == 401
        text = httpx.get(sim.url + "/metrics").text
        samples = parse_prometheus(text)
        assert samples['sglang:num_running_reqs{model_name="qwen"}'] == 0
        assert samples['sglang:num_queue_reqs{model_name="qwen"}'] == 0
        assert samples['sglang:generation_tokens_total{model_name="qwen"}'] == 6
        assert httpx.get(sim.url + "/get_model_info").json()["model_path"] == "org/model"
        # SGLang's OpenAI routes answer any model name with the model they serve
        # (sgl-project/sglang#7035, #10065); the answer repeats the name asked for.
        r = httpx.post(
            sim.url + "/v1/chat/completions",
            headers={"Authorization": "Bearer k"},
            json={"model": "other", "messages": [{"role": "user", "content": "x"}]},
        )
        assert r.status_code == 200
        assert r.json()["model"] == "other"
        # A "base:adapter" model names an adapter, and none is loaded.
        r = httpx.post(
            sim.url + "/v1/chat/completions",
            headers={"Authorization": "Bearer k"},
            json={"model": "qwen:sql", "messages": [{"role": "user", "content": "x"}]},
        )
        assert r.status_code == 400
        assert "requested LoRA adapters are not loaded: sql" in r.json()["message"]


def test_sglang_unknown_flag_exits_2(tmp_path: Path) -> None:
    proc = run_to_exit(tmp_path, [*SIM, "sglang", "--model-path", "m", "--bogus"])
    assert proc.returncode == 2
    assert "unrecognized arguments: --bogus" in proc.output


def test_llama_server_health_while_loading_then_ok(tmp_path: Path) -> None:
    port = free_port()
    loaded = tmp_path / "loaded"
    args = ["--alias", "tiny", "--sim-load-until", str(loaded)]
    with Proc(engine_argv("llama-server", port, args), log_dir=tmp_path) as proc:
        proc.wait_output("main: loading model")
        url = f"http://127.0.0.1:{port}"
        status, body = wait_for(lambda: http_get(url + "/health"), what="llama /health answers")
        assert status == 503
        assert httpx.Response(503, content=body).json() == {
            "error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}
        }
        loaded.touch()
        proc.wait_output("starting the main loop")
        assert http_get(url + "/health") == (200, b'{"status":"ok"}')
        # Without --metrics llama-server answers /metrics with 501.
        status, body = http_get(url + "/metrics")
        assert status == 501
        assert b"not_supported_error" in body


def test_llama_server_api_metrics_and_key(tmp_path: Path) -> None:
    args = ["--alias", "tiny", "--metrics", "-c", "2048", "-t", "4", "--api-key", "k1,k2"]
    with start(tmp_path, "llama-server", args) as sim:
        _stream_with_usage(sim, "tiny", api_key="k2")
        models = httpx.get(sim.url + "/v1/models").json()
        assert models["data"][0]["id"] == "tiny"
        r = httpx.post(sim.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
        r = httpx.get(sim.url + "/metrics", headers={"X-Api-Key": "k1"})
        samples = parse_prometheus(r.text)
        assert samples["llamacpp:requests_processing"] == 0
        assert samples["llamacpp:tokens_predicted_total"] == 6
        assert "llamacpp:kv_cache_usage_ratio" in samples
        # llama.cpp rejects a prompt that does not fit, but cuts a long generation short.
        r = httpx.post(
            sim.url + "/v1/completions",
            headers={"Authorization": "Bearer k1"},
            json={"prompt": "x " * 2100, "max_tokens": 4},
        )
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["type"] == "exceed_context_size_error"
        assert err["n_ctx"] == 2048
        r = httpx.post(
            sim.url + "/v1/completions",
            headers={"Authorization": "Bearer k1"},
            json={"prompt": "x " * 2000, "max_tokens": 4000},
        )
        assert r.status_code == 200
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["total_tokens"] == 2048


def test_llama_server_unknown_flag_and_load_failure(tmp_path: Path) -> None:
    proc = run_to_exit(tmp_path, [*SIM, "llama-server", "-m", "x.gguf", "--bogus"])
    assert proc.returncode == 1
    assert "error: invalid argument: --bogus" in proc.output
    proc = run_to_exit(
        tmp_path,
        engine_argv("llama-server", free_port(), ["--sim-fail-on-load", "bad magic"]),
    )
    assert proc.returncode == 1
    assert "llama_model_load: error loading model: bad magic" in proc.output
    assert "main: exiting due to model loading error" in proc.tail(1)


def test_sglang_worker_rank_serves_only_health(tmp_path: Path) -> None:
    args = [
        "--tp-size",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--dist-init-addr",
        "10.0.0.1:5000",
    ]
    with start(tmp_path, "sglang", args, env={"CUDA_VISIBLE_DEVICES": "3"}) as sim:
        assert httpx.get(sim.url + "/health").status_code == 200
        assert httpx.get(sim.url + "/v1/models").status_code == 404
