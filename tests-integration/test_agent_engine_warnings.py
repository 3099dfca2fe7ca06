"""An agent set up for one engine does not warn about the others (issue 29 point 8).

`llmgw-agent inventory --engines --json` (warnings only, on stderr) with agent.yaml
setting up vLLM (the simulator) and llama.cpp at a path that does not exist, and
leaving SGLang at its default command, which does not run here: the llama.cpp it was
told to use is warned about; SGLang, which nothing asked for, is not (before, every
engine not installed was a warning).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml
from llmgw_testkit.cluster import bin_path


def test_only_the_engines_agent_yaml_sets_up_are_warned_about(tmp_path: Path) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "node_id": "n1",
                "control": {"address": "127.0.0.1:9", "tls": {"insecure": True}},
                "simulate_gpus": {"count": 1, "name": "NVIDIA H200", "memory": "141GB"},
                "state_dir": str(tmp_path / "state"),
                "engines": {
                    "vllm": {"command": [bin_path("llmgw-sim"), "vllm"], "flags_from": "captured"},
                    "llamacpp": {"command": [str(tmp_path / "missing" / "llama-server")]},
                },
            }
        )
    )
    done = subprocess.run(
        [bin_path("llmgw-agent"), "inventory", "--engines", "--json", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    engines = {
        e["kind"].removeprefix("ENGINE_KIND_").lower(): e
        for e in json.loads(done.stdout)["engines"]
    }
    assert not engines["vllm"].get("error"), engines["vllm"]
    assert engines["sglang"].get("error"), "SGLang runs here after all: the test needs it not to"
    warned = [line for line in done.stderr.splitlines() if "engine unusable" in line]
    assert len(warned) == 1, done.stderr
    assert "llamacpp" in warned[0]
    assert "sglang" not in done.stderr, done.stderr
