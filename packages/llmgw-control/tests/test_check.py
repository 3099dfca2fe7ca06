"""`llmgw-control check --config FILE` (issue 29 point 9): a config judged without
starting anything; parallel sizes against the GPUs a replica gets (examples and a
hypothesis property), and the command's exit statuses, also against a running control
plane's nodes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from hypothesis import given
from hypothesis import strategies as st
from llmgw_control.check import parallel_problem

Factory = Callable[..., Any]


def test_parallel_sizes_examples() -> None:
    assert parallel_problem("vllm", ["--tensor-parallel-size", "4"], 4, 1) == ""
    assert parallel_problem("vllm", ["-tp", "2", "-pp", "2"], 2, 2) == ""
    assert parallel_problem("vllm", ["--tensor-parallel-size=8"], 4, 1) == (
        "--tensor-parallel-size 8 = 8 GPUs, but a replica gets 4 (gpus_per_node 4 x nodes 1)"
    )
    assert parallel_problem("sglang", ["--tp-size", "2"], 4, 1).startswith("--tp-size 2 = 2 GPUs")
    assert parallel_problem("vllm", ["-pp", "3"], 4, 1).startswith("-pp 3 do not divide")
    assert parallel_problem("vllm", ["-tp", "two"], 4, 1) == "-tp 'two' is not a whole number"
    assert parallel_problem("vllm", ["--max-model-len", "4096"], 4, 1) == ""
    assert parallel_problem("llamacpp", ["-tp", "8"], 1, 1) == ""  # no such sizes there
    assert parallel_problem("vllm", ["-tp", "8"], 0, 1) == ""  # CPU-only: nothing to fill


@given(
    st.integers(1, 8),
    st.integers(1, 4),
    st.integers(1, 8),
    st.integers(1, 4),
    st.sampled_from(["vllm", "sglang"]),
)
def test_sizes_that_use_every_gpu_pass_and_others_do_not(
    gpus: int, nodes: int, tp: int, pp: int, engine: str
) -> None:
    names = {"vllm": ("-tp", "-pp"), "sglang": ("--tp-size", "--pp-size")}[engine]
    args = [names[0], str(tp), names[1], str(pp)]
    problem = parallel_problem(engine, args, gpus, nodes)
    assert (problem == "") == (tp * pp == gpus * nodes), problem


def write(tmp_path: Path, profile: dict[str, Any], name: str = "control.yaml") -> Path:
    path = tmp_path / name
    path.write_text(
        yaml.safe_dump(
            {
                "tls": {"insecure": True},
                "models": [{"name": "chat", "profiles": {"big": {"engine": "vllm", **profile}}}],
            }
        )
    )
    return path


def check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw_control", "check", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_command_exit_statuses(tmp_path: Path) -> None:
    good = check(
        "--config", str(write(tmp_path, {"gpus_per_node": 4, "engine_args": ["-tp", "4"]}))
    )
    assert good.returncode == 0, good.stdout + good.stderr
    assert "nothing wrong found" in good.stdout
    bad = check(
        "--config",
        str(write(tmp_path, {"gpus_per_node": 4, "engine_args": ["-tp", "8"]}, "b.yaml")),
    )
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert (
        "models[chat].profiles.big.engine_args: -tp 8 = 8 GPUs, but a replica gets 4" in bad.stdout
    )
    refused = check("--config", str(write(tmp_path, {"gpus_per_node": -1}, "c.yaml")))
    assert refused.returncode == 2
    assert "gpus_per_node" in refused.stderr
    assert "Traceback" not in refused.stderr


async def test_against_a_running_control_plane(
    tmp_path: Path, control_factory: Factory, agent_factory: Factory
) -> None:
    control = control_factory([])
    agent = agent_factory(control.grpc_port, "gpu-a", gpus=2)
    agent.start()
    await control.until(lambda s: any(n["state"] == "READY" for n in s["nodes"]), "the node ready")
    config = write(tmp_path, {"gpus_per_node": 4}, "fleet.yaml")
    done = await asyncio.to_thread(
        check, "--config", str(config), "--admin", f"127.0.0.1:{control.admin_port}"
    )
    assert done.returncode == 1, done.stdout + done.stderr
    # The fake agent reports no engines: nothing could run the profile.
    assert "models[chat].profiles.big.engine: no ready node offers a usable vllm" in done.stdout
