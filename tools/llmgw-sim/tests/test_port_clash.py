"""Two engines on one port: the loser exits non-zero in its engine's own words (issue 13.2)."""

from __future__ import annotations

from pathlib import Path

import pytest
from llmgw_sim.testing import engine_argv, start
from llmgw_testkit import Proc, free_port, http_get, wait_for

# What each real engine prints when its API port is taken (vLLM 0.32: a traceback out of
# create_server_socket's sock.bind; SGLang: uvicorn's bind error; llama-server b11434:
# cpp-httplib's bind failure, which names no errno), and the exit code it ends with.
LOSER = {
    "vllm": (1, ["sock.bind(addr)", "OSError: [Errno 98] Address already in use"]),
    "sglang": (
        3,
        [
            "ERROR:    [Errno 98] error while attempting to bind on address "
            "('127.0.0.1', {port}): address already in use"
        ],
    ),
    "llama-server": (
        1,
        [
            "start: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: {port}",
            "llama_server: exiting due to HTTP server error",
        ],
    ),
}
ENV = {"CUDA_VISIBLE_DEVICES": "0"}


def _argv(kind: str, port: int, extra: list[str]) -> list[str]:
    return engine_argv(kind, port, extra)


@pytest.mark.parametrize("kind", ["vllm", "sglang", "llama-server"])
def test_second_engine_on_a_taken_port_exits_non_zero(tmp_path: Path, kind: str) -> None:
    with start(tmp_path / "first", kind) as sim:
        with Proc(_argv(kind, sim.port, []), log_dir=tmp_path / "second", env=ENV) as loser:
            code = loser.wait(timeout=60)
            out = loser.output()
        code_wanted, lines = LOSER[kind]
        assert code == code_wanted, out
        for line in lines:
            assert line.format(port=sim.port) in out, out
        assert "Application startup complete." not in out
        assert "starting the main loop" not in out
        # The winner is untouched.
        assert http_get(sim.url + "/health")[0] == 200


def test_vllm_bound_while_loading_loses_when_another_listens_first(tmp_path: Path) -> None:
    """vLLM binds at start and listens only once loaded, so two started together both
    bind; the one that finishes loading second must fail, not log ready and serve nothing."""
    port = free_port()
    loaded = tmp_path / "loaded"
    slow = _argv("vllm", port, ["--sim-load-until", str(loaded)])
    with Proc(slow, log_dir=tmp_path / "slow", env=ENV) as late:
        late.wait_output("Starting to load model org/model")
        with Proc(_argv("vllm", port, []), log_dir=tmp_path / "fast", env=ENV) as first:
            wait_for(
                lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200,
                timeout=30,
                what="the first vLLM to load answers /health",
            )
            loaded.touch()
            code = late.wait(timeout=60)
            out = late.output()
            assert code == 1, out
            assert "OSError: [Errno 98] Address already in use" in out, out
            assert "Application startup complete." not in out
            assert first.alive()
            assert http_get(f"http://127.0.0.1:{port}/health")[0] == 200
