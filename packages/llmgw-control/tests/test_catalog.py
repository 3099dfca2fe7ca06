"""Catalog and config validation: every refusal names the file and the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from llmgw_control.catalog import build_catalog
from llmgw_control.config import ControlConfig, load_control_config
from llmgw_control.inventory import GpuSlot, NodeState
from llmgw_control.placement import Demand, NodeView
from llmgw_proto.config import ConfigError, convert


def write(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "control.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def error_of(tmp_path: Path, data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        load_control_config(write(tmp_path, data))
    return str(info.value)


def test_defaults_and_resolved_profile(tmp_path: Path) -> None:
    loaded = load_control_config(
        write(
            tmp_path,
            {
                "models": [
                    {
                        "name": "llama-3-8b",
                        "profiles": {
                            "fast": {
                                "engine": "vllm",
                                "engine_args": ["--max-model-len", "4096"],
                                "gpu": {"name": "NVIDIA H100*", "min_memory": "40GiB"},
                                "replicas": 2,
                                "load_timeout": "5m",
                            }
                        },
                    }
                ]
            },
        )
    )
    assert loaded.config.listen == "0.0.0.0:7070"
    assert loaded.config.admin_listen == "127.0.0.1:9091"
    assert loaded.config.control.port_range == (20000, 29999)
    (profile,) = loaded.catalog.profiles
    assert profile.key == ("llama-3-8b", "fast")
    assert profile.served_model_names == ("llama-3-8b",)
    assert profile.model_ref == "llama-3-8b"
    assert profile.min_memory_bytes == 40 * 2**30
    assert profile.load_timeout == 300.0
    assert profile.engine_args == ("--max-model-len", "4096")
    # The profile's GPU constraint, as placement applies it (one place, NodeView.eligible).
    demand = Demand.of(profile)
    node = NodeView(
        "n",
        NodeState.READY,
        (
            GpuSlot(0, "NVIDIA H100 80GB HBM3", 80 * 2**30),
            GpuSlot(1, "NVIDIA A10", 80 * 2**30),
            GpuSlot(2, "NVIDIA H100 PCIe", 20 * 2**30),
        ),
    )
    assert node.eligible(demand.gpu_name, demand.min_memory_bytes) == (0,)


def test_model_without_profiles_points_at_static_endpoints(tmp_path: Path) -> None:
    message = error_of(
        tmp_path,
        {"models": [{"name": "a", "profiles": {"p": {"engine": "vllm"}}}, {"name": "b"}]},
    )
    assert message.endswith(
        "control.yaml: $.models[1].profiles: a model needs at least one profile "
        "(a router-only run uses static endpoints: llmgw-router serve --endpoint ...)"
    )


@pytest.mark.parametrize(
    ("profile", "field", "words"),
    [
        ({"engine": "tgi"}, "$.models[0].profiles.p.engine", "Invalid enum value"),
        ({"engine": "vllm", "gpus_per_node": -1}, "profiles.p.gpus_per_node", ">= 0"),
        ({"engine": "vllm", "nodes": 0}, "profiles.p.nodes", ">= 1"),
        (
            {"engine": "vllm", "gpu": {"min_memory": "lots"}},
            "profiles.p.gpu.min_memory",
            "like `80GiB`",
        ),
        ({"engine": "vllm", "gpus_per_node": 0, "gpu": {"name": "H100*"}}, "p.gpu", "CPU-only"),
        ({"engine": "vllm", "cpu_threads": 4}, "profiles.p.cpu_threads", "CPU-only"),
        ({"engine": "vllm", "same_label": "fabric.x"}, "profiles.p.same_label", "multi-node"),
        ({"engine": "llamacpp", "nodes": 2}, "profiles.p.nodes", "one node"),
        ({"engine": "vllm", "env": {"CUDA_VISIBLE_DEVICES": "0"}}, "env.CUDA_VISIBLE", "agent"),
        ({"engine": "vllm", "served_model_names": ["a", "a"]}, "served_model_names", "repeat"),
        (
            {"engine": "vllm", "replicas": "two"},
            "profiles.p.replicas",
            "Expected `int | object`, got `str`",
        ),
        ({"engine": "vllm", "gpus": 2}, "profiles.p", "unknown field `gpus`"),
        ({"engine": "vllm", "load_timeout": "soon"}, "profiles.p.load_timeout", "duration"),
    ],
)
def test_profile_errors_name_the_field(
    tmp_path: Path, profile: dict[str, Any], field: str, words: str
) -> None:
    message = error_of(tmp_path, {"models": [{"name": "m", "profiles": {"p": profile}}]})
    assert message.startswith(str(tmp_path / "control.yaml") + ": $.models[0].")
    assert field in message
    assert words in message


def test_duplicate_model_and_shared_served_name(tmp_path: Path) -> None:
    p = {"p": {"engine": "vllm"}}
    message = error_of(tmp_path, {"models": [{"name": "m", "profiles": p}] * 2})
    assert "$.models[1].name: model 'm' is already defined at $.models[0]" in message
    message = error_of(
        tmp_path,
        {
            "models": [
                {"name": "m", "profiles": p},
                {"name": "n", "profiles": {"q": {"engine": "vllm", "served_model_names": ["m"]}}},
            ]
        },
    )
    assert "$.models[1].profiles.q.served_model_names" in message
    assert "already served by model 'm'" in message


@pytest.mark.parametrize(
    ("control", "field"),
    [
        ({"port_range": [30000, 20000]}, "$.control.port_range"),
        ({"port_range": [0, 20000]}, "$.control.port_range[0]"),
        ({"unreachable_after": "1s", "heartbeat_interval": "2s"}, "$.control.unreachable_after"),
        ({"unreachable_after": "10s", "lost_after": "5s"}, "$.control.lost_after"),
        ({"base_backoff": "10s", "max_backoff": "1s"}, "$.control.max_backoff"),
        ({"interval": "fast"}, "$.control.interval"),
    ],
)
def test_control_settings_errors(tmp_path: Path, control: dict[str, Any], field: str) -> None:
    assert f"control.yaml: {field}: " in error_of(tmp_path, {"control": control})


def test_listen_must_be_host_port(tmp_path: Path) -> None:
    assert "$.listen: expected HOST:PORT" in error_of(tmp_path, {"listen": "7070"})


UNITS = {"": 1, "B": 1, "MiB": 2**20, "GiB": 2**30, "Gi": 2**30, "GB": 10**9, "G": 10**9}


@given(st.integers(min_value=0, max_value=2**20), st.sampled_from(sorted(UNITS)))
def test_min_memory_units(number: int, unit: str) -> None:
    """min_memory takes llmgw_proto.sizes' grammar, the agent's: 80G and 80Gi too."""
    for given_as in (f"{number}{unit}", number * UNITS[unit]):
        config = {
            "models": [
                {
                    "name": "m",
                    "profiles": {"p": {"engine": "vllm", "gpu": {"min_memory": given_as}}},
                }
            ]
        }
        (profile,) = build_catalog(convert(config, ControlConfig, source="x").models, "x").profiles
        assert profile.min_memory_bytes == number * UNITS[unit]


def test_min_memory_refusal_names_the_field(tmp_path: Path) -> None:
    message = error_of(
        tmp_path,
        {
            "models": [
                {"name": "m", "profiles": {"p": {"engine": "vllm", "gpu": {"min_memory": "lots"}}}}
            ]
        },
    )
    assert "$.models[0].profiles.p.gpu.min_memory: " in message
    assert "'lots'" in message
