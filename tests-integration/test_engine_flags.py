"""Engine flags and model checks, through the whole system: a profile the real engine
would refuse only after minutes of loading is refused by the agent at once, with the
reason, and nothing is launched."""

from __future__ import annotations

import json
from pathlib import Path

from llmgw_testkit import wait_for
from llmgw_testkit.cluster import Cluster, vllm_profile


def test_removed_flags_and_model_limits_are_refused_before_launch(
    cluster: Cluster, tmp_path: Path
) -> None:
    model = tmp_path / "models" / "small"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    (model / "model.safetensors").write_bytes(b"\0" * 1024)
    models = [
        {
            # --swap-space was removed in vLLM 0.30: vLLM 0.32's own help says so.
            "name": "old-flag",
            "profiles": {"default": vllm_profile(args=["--swap-space", "4"])},
        },
        {
            "name": "too-long",
            "profiles": {
                "default": vllm_profile(args=["--max-model-len", "8192"], model_ref=str(model))
            },
        },
    ]
    cluster.start_control(models)
    cluster.start_agent("gpu-a", gpus=2)

    def failed(name: str) -> dict[str, object] | None:
        found = [r for r in cluster.replicas(name) if int(r["failures"]) >= 1]
        return found[0] if found else None

    old = wait_for(lambda: failed("old-flag"), timeout=60, what="old-flag refused")
    assert "unknown engine argument '--swap-space' for vllm" in str(old["last_error"])
    long = wait_for(lambda: failed("too-long"), timeout=60, what="too-long refused")
    assert "--max-model-len 8192 (8192 tokens) is more than the model allows: 2048 tokens" in str(
        long["last_error"]
    )
    assert cluster.engine_pids() == []
