"""The console script and knobs that only show as a running process behaves."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from llmgw_sim.testing import SIM, engine_argv, run_to_exit, start

SCRIPT = str(Path(sys.executable).parent / "llmgw-sim")


def test_console_script_help_lists_knobs_and_env_vars() -> None:
    out = subprocess.run([SCRIPT, "--help"], capture_output=True, text=True, timeout=30, check=True)
    assert "llmgw-sim vllm serve MODEL" in out.stdout
    assert "--sim-itl / LLMGW_SIM_ITL" in out.stdout
    assert "--sim-crash-after-requests / LLMGW_SIM_CRASH_AFTER_REQUESTS" in out.stdout


def test_console_script_lists_flags() -> None:
    out = subprocess.run(
        [SCRIPT, "flags", "vllm"], capture_output=True, text=True, timeout=30, check=True
    )
    flags = out.stdout.split()
    assert "--tensor-parallel-size" in flags
    assert "--no-enable-prefix-caching" in flags


def test_unknown_engine_and_subcommand_exit_2(tmp_path: Path) -> None:
    proc = run_to_exit(tmp_path, [SCRIPT, "tgi"])
    assert proc.returncode == 2
    assert "unknown engine 'tgi'" in proc.output
    proc = run_to_exit(tmp_path, [*SIM, "vllm", "bench"])
    assert proc.returncode == 2
    assert "only 'vllm serve' is simulated" in proc.output


def test_port_out_of_range_is_a_clear_error(tmp_path: Path) -> None:
    proc = run_to_exit(tmp_path, [*SIM, "vllm", "serve", "m", "--port", "70000"])
    assert proc.returncode == 1
    assert "port 70000 is out of range" in proc.output
    assert "Traceback" not in proc.output


def test_port_in_use_fails_like_vllm(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_to_exit(
            tmp_path, engine_argv("vllm", port, []), env={"CUDA_VISIBLE_DEVICES": "0"}
        )
    assert proc.returncode == 1
    # vLLM 0.32's own words: the traceback out of create_server_socket's sock.bind.
    assert proc.output.rstrip().endswith("OSError: [Errno 98] Address already in use")


def test_error_rate_access_log_and_continuous_usage(tmp_path: Path) -> None:
    args = ["--sim-error-rate", "1", "--sim-error-status", "429", "--sim-log-requests"]
    with start(tmp_path, "vllm", args) as sim:
        with (
            openai.OpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0) as c,
            pytest.raises(openai.RateLimitError),
        ):
            c.chat.completions.create(
                model="org/model", messages=[{"role": "user", "content": "x"}]
            )
        sim.proc.wait_output('"POST /v1/chat/completions HTTP/1.1" 429')


def test_continuous_usage_stats_on_every_chunk(tmp_path: Path) -> None:
    with start(tmp_path, "vllm", ["--sim-mode", "echo"]) as sim:
        body = {
            "model": "org/model",
            "messages": [{"role": "user", "content": "echo me"}],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        with httpx.stream("POST", sim.url + "/v1/chat/completions", json=body) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
        chunks = [json.loads(e) for e in events]
        assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2, 3, 4, 4]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        # Echo mode repeats the rendered prompt's tokens: "<", "|", "user", "|".
        assert text == "<|user|"
        assert chunks[-1]["choices"] == []
