"""Start-up, failures and shutdown of the vLLM stand-in, as a real process."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx
import pytest
from llmgw_sim.metrics import parse_prometheus
from llmgw_sim.testing import SIM, engine_argv, run_to_exit, start
from llmgw_testkit import Proc, free_port, http_get, port_open, wait_for_async

CHAT = {"model": "org/model", "messages": [{"role": "user", "content": "hi"}]}


def test_vllm_refuses_connections_until_ready(tmp_path: Path) -> None:
    port = free_port()
    loaded = tmp_path / "loaded"
    argv = engine_argv("vllm", port, ["--sim-load-until", str(loaded)])
    with Proc(argv, log_dir=tmp_path, env={"CUDA_VISIBLE_DEVICES": "0"}) as proc:
        proc.wait_output("Starting to load model org/model")
        assert not port_open(port), "vLLM must not accept connections while loading"
        loaded.touch()
        proc.wait_output("Application startup complete.")
        assert http_get(f"http://127.0.0.1:{port}/health")[0] == 200
        out = proc.output()
        assert "vLLM API server version" in out
        assert "non-default args:" in out
        assert "GPU KV cache size: 131,072 tokens" in out
        assert out.index("GPU KV cache size") < out.index("Application startup complete.")


def test_unknown_flag_exits_2(tmp_path: Path) -> None:
    proc = run_to_exit(tmp_path, [*SIM, "vllm", "serve", "m", "--no-such-flag"])
    assert proc.returncode == 2
    assert "vllm serve: error: unrecognized arguments: --no-such-flag" in proc.output


def test_bad_knob_exits_2_naming_it(tmp_path: Path) -> None:
    proc = run_to_exit(tmp_path, [*SIM, "vllm", "serve", "m", "--sim-itl", "soon"])
    assert proc.returncode == 2
    assert "llmgw-sim: error: --sim-itl: expected float, got 'soon'" in proc.output
    assert "Traceback" not in proc.output


@pytest.mark.parametrize(
    ("visible", "tp", "message"),
    [
        ("0", "2", "World size (2) is larger than the number of available GPUs (1)"),
        ("0,1,2,3", "2", "World size (2) does not match the number of visible GPUs (4)"),
        ("", "1", "No CUDA GPUs are available"),
    ],
)
def test_gpu_mismatch_fails_start_up(tmp_path: Path, visible: str, tp: str, message: str) -> None:
    port = free_port()
    proc = run_to_exit(
        tmp_path,
        engine_argv("vllm", port, ["--tensor-parallel-size", tp]),
        env={"CUDA_VISIBLE_DEVICES": visible},
    )
    assert proc.returncode == 1
    out = proc.output
    assert message in out
    assert "Traceback (most recent call last):" in out


def test_tp_times_pp_matching_devices_starts(tmp_path: Path) -> None:
    args = ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"]
    with start(tmp_path, "vllm", args, env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) as sim:
        assert "tensor_parallel_size=2, pipeline_parallel_size=2" in sim.proc.output()


def test_low_free_memory_fails_like_vllm(tmp_path: Path) -> None:
    proc = run_to_exit(
        tmp_path,
        engine_argv("vllm", free_port(), ["--sim-free-memory-fraction", "0.5"]),
        env={"CUDA_VISIBLE_DEVICES": "0"},
    )
    assert proc.returncode == 1
    out = proc.output
    assert (
        "ValueError: Free memory on device cuda:0 (40.00/80.00 GiB) on startup is less than" in out
    )
    assert "desired GPU memory utilization (0.9" in out
    assert out.rstrip().endswith("Failed core proc(s): {}")


def test_fail_on_load_with_message_and_exit_code(tmp_path: Path) -> None:
    proc = run_to_exit(
        tmp_path,
        engine_argv("vllm", free_port(), ["--sim-exit-code", "3"]),
        env={"CUDA_VISIBLE_DEVICES": "0", "LLMGW_SIM_FAIL_ON_LOAD": "weights are corrupt"},
    )
    assert proc.returncode == 3
    out = proc.output
    assert "EngineCore failed to start." in out
    assert "RuntimeError: weights are corrupt" in out
    assert "Engine core initialization failed" in proc.tail(2)


def test_crash_after_requests(tmp_path: Path) -> None:
    with start(tmp_path, "vllm", ["--sim-crash-after-requests", "2"]) as sim:
        with httpx.Client(timeout=10) as c:
            for _ in range(2):
                r = c.post(sim.url + "/v1/chat/completions", json=CHAT)
                assert r.status_code == 200
        assert sim.proc.wait(timeout=10) == 1
        out = sim.proc.output()
        assert "EngineCore encountered a fatal error." in out
        assert "EngineDeadError" in out


def test_crash_after_seconds(tmp_path: Path) -> None:
    with start(
        tmp_path, "vllm", ["--sim-crash-after-seconds", "0.5", "--sim-exit-code", "7"]
    ) as sim:
        assert sim.proc.wait(timeout=15) == 7
        assert "RuntimeError: CUDA error: an illegal memory access" in sim.proc.output()


def test_headless_rank_serves_nothing_until_sigterm(tmp_path: Path) -> None:
    port = free_port()
    args = [
        "--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1",
        "--master-addr", "10.0.0.1", "--master-port", "29600", "--headless",
        "--distributed-executor-backend", "mp",
    ]  # fmt: skip
    with Proc(
        engine_argv("vllm", port, args), log_dir=tmp_path, env={"CUDA_VISIBLE_DEVICES": "2,3"}
    ) as proc:
        proc.wait_output("waiting for work from the leader")
        assert "10.0.0.1:29600" in proc.output()
        assert not port_open(port)
        proc.signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


async def _stream_all(
    url: str, body: dict[str, object], headers: dict[str, str] | None = None
) -> list[str]:
    async with (
        httpx.AsyncClient(timeout=30) as c,
        c.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r,
    ):
        assert r.status_code == 200
        return [line async for line in r.aiter_lines() if line]


async def test_sigterm_lets_running_requests_finish(tmp_path: Path) -> None:
    with start(tmp_path, "vllm", ["--sim-itl", "0.05"]) as sim:
        body = {**CHAT, "max_tokens": 30, "stream": True}
        # An idle keep-alive connection: shutdown closes it at once.
        reader, writer = await asyncio.open_connection("127.0.0.1", sim.port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        task = asyncio.create_task(_stream_all(sim.url, body))
        await wait_for_async(
            lambda: asyncio.to_thread(sim.metric, "vllm:num_requests_running"),
            what="a running request",
        )
        sim.proc.signal(signal.SIGTERM)
        await wait_for_async(
            lambda: asyncio.to_thread(lambda: not port_open(sim.port)), what="listener closed"
        )
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the server
        writer.close()
        events = await task
        assert events[-1] == "data: [DONE]"
        assert sum('"content"' in e for e in events) == 31  # role chunk + 30 tokens
        assert await asyncio.to_thread(sim.proc.wait, 10) == 0
        assert "Waiting for 1 running request(s) to finish" in sim.proc.output()


async def test_queue_holds_requests_beyond_max_num_seqs(tmp_path: Path) -> None:
    with start(tmp_path, "vllm", ["--max-num-seqs", "1"]) as sim:
        seen: list[str] = []

        async def read_stalled() -> None:
            body = {**CHAT, "stream": True}
            headers = {"X-Sim-Stall-After": "2"}
            async with (
                httpx.AsyncClient(timeout=30) as c,
                c.stream("POST", sim.url + "/v1/chat/completions", json=body, headers=headers) as r,
            ):
                async for line in r.aiter_lines():
                    if line:
                        seen.append(line)

        stalled = asyncio.create_task(read_stalled())
        # The stream stalls after 2 tokens (role chunk + 2) and stays open and running.
        await wait_for_async(lambda: asyncio.sleep(0, len(seen) >= 3), what="role + 2 tokens")
        await wait_for_async(
            lambda: asyncio.to_thread(lambda: sim.metric("vllm:num_requests_running") == 1),
            what="stalled stream running",
        )
        async with httpx.AsyncClient(timeout=30) as c:
            queued = asyncio.create_task(c.post(sim.url + "/v1/chat/completions", json=CHAT))
            await wait_for_async(
                lambda: asyncio.to_thread(lambda: sim.metric("vllm:num_requests_waiting") == 1),
                what="second request waiting",
            )
            assert sim.metric("vllm:num_requests_running") == 1
            assert not queued.done()
            assert not stalled.done()
            assert len(seen) == 3
            assert all("[DONE]" not in line for line in seen)
            stalled.cancel()  # the client gives up on the stalled stream
            r = await queued
            assert r.status_code == 200
        await wait_for_async(
            lambda: asyncio.to_thread(lambda: sim.metric("vllm:num_requests_running") == 0),
            what="all requests finished",
        )
        abort = (
            'vllm:request_success_total{engine="0",model_name="org/model",finished_reason="abort"}'
        )
        _, page = await asyncio.to_thread(http_get, sim.url + "/metrics")
        assert parse_prometheus(page.decode())[abort] == 1
        with pytest.raises(asyncio.CancelledError):
            await stalled
