"""The LoRA flags the control plane's catalog adds to a profile are flags the engines'
captured help accepts (issue 30). Here, not in either package's tests: it needs both the
control plane's catalog and the agent's engine help, and the programs never import each other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from llmgw_agent.engine_flags import captured
from llmgw_control.config import load_control_config


def write(tmp_path: Path, models: list[dict[str, Any]]) -> Path:
    path = tmp_path / "control.yaml"
    path.write_text(yaml.safe_dump({"models": models}))
    return path


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_lora_flags_pass_the_engine_help(tmp_path: Path, engine: str) -> None:
    model = {
        "name": "gemma",
        "profiles": {"default": {"engine": engine, "lora": {"max_loras": 4, "max_rank": 64}}},
        "adapters": [{"name": "sql", "source": "/models/sql"}],
    }
    profile = load_control_config(write(tmp_path, [model])).catalog.profiles[0]
    assert "--enable-lora" in profile.engine_args
    assert list(captured(engine).parse(profile.engine_args).errors) == []
