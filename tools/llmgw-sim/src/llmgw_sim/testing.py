"""Run the simulator as a real process in tests (needs llmgw-testkit, as dev envs have).

``with start(tmp_path, "vllm", ["--max-num-seqs", "4"]) as sim:`` starts
``llmgw-sim vllm serve org/model`` on a free loopback port, waits for /health,
and stops the process group when the block ends, even on failure.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from llmgw_testkit import Proc, free_port, http_get, wait_for

from llmgw_sim.metrics import parse_prometheus, sample

SIM = [sys.executable, "-m", "llmgw_sim"]


@dataclass
class Sim:
    proc: Proc
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metric(self, name: str) -> float:
        status, body = http_get(self.url + "/metrics")
        assert status == 200, body
        value = sample(parse_prometheus(body.decode()), name)
        assert value is not None, f"{name} missing from /metrics"
        return value

    def wait_metric(self, name: str, value: float, timeout: float = 15.0) -> None:
        wait_for(lambda: self.metric(name) == value, timeout=timeout, what=f"{name} == {value}")


def engine_argv(kind: str, port: int, args: list[str]) -> list[str]:
    if kind == "vllm":
        return [
            *SIM,
            "vllm",
            "serve",
            "org/model",
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            *args,
        ]
    if kind == "sglang":
        return [*SIM, "sglang", "--model-path", "org/model", "--port", str(port), *args]
    return [*SIM, "llama-server", "-m", "/models/m.gguf", "--port", str(port), *args]


def wait_healthy(sim: Sim, timeout: float = 30.0) -> None:
    def healthy() -> bool:
        if not sim.proc.alive():
            raise AssertionError(f"simulator exited early:\n{sim.proc.tail()}")
        return http_get(sim.url + "/health")[0] == 200

    wait_for(healthy, timeout=timeout, what="/health == 200")


@contextlib.contextmanager
def start(
    log_dir: Path,
    kind: str = "vllm",
    args: list[str] | None = None,
    env: Mapping[str, str] | None = None,
    *,
    healthy: bool = True,
) -> Iterator[Sim]:
    port = free_port()
    # One visible GPU unless a test says otherwise: matches the default -tp 1.
    full_env = {"CUDA_VISIBLE_DEVICES": "0", **(env or {})}
    with Proc(engine_argv(kind, port, args or []), log_dir=log_dir, env=full_env, grace=10) as proc:
        sim = Sim(proc, port)
        if healthy:
            wait_healthy(sim)
        yield sim


@dataclass
class Exited:
    returncode: int
    output: str

    def tail(self, lines: int = 2) -> str:
        return "\n".join(self.output.splitlines()[-lines:])


def run_to_exit(
    log_dir: Path, argv: list[str], env: Mapping[str, str] | None = None, timeout: float = 30.0
) -> Exited:
    """Run a simulator that is expected to exit on its own; return its code and output."""
    with Proc(argv, log_dir=log_dir, env=env) as proc:
        code = proc.wait(timeout=timeout)
        return Exited(code, proc.output())
