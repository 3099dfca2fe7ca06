"""Scenario 6: a profile the agent refuses fails fast with the reason; the control plane
backs off instead of retrying in a tight loop, and launches nothing."""

from __future__ import annotations

from llmgw_testkit import wait_for
from llmgw_testkit.cluster import Cluster, poll, vllm_profile


def test_refused_profiles_fail_fast_and_back_off(cluster: Cluster) -> None:
    models = [
        {
            "name": "bad-flag",
            "profiles": {"default": vllm_profile(gpus=1, args=["--no-such-flag", "1"])},
        },
        {
            "name": "bad-gpus",
            "profiles": {"default": vllm_profile(gpus=2, args=["--tensor-parallel-size", "4"])},
        },
    ]
    cluster.start_control(models)
    cluster.start_agent("gpu-a", gpus=4)

    def failed(model: str) -> dict[str, object] | None:
        found = [r for r in cluster.replicas(model) if int(r["failures"]) >= 1]
        return found[0] if found else None

    flag = wait_for(lambda: failed("bad-flag"), timeout=30, what="bad-flag refused")
    assert "--no-such-flag" in str(flag["last_error"])
    gpus = wait_for(lambda: failed("bad-gpus"), timeout=30, what="bad-gpus refused")
    assert "tensor" in str(gpus["last_error"]).lower()
    assert "4" in str(gpus["last_error"])
    assert "2" in str(gpus["last_error"])

    # Watch for several seconds: with base_backoff 1s doubling to 8s, a handful of
    # attempts at most, never a tight loop.
    seen = poll(lambda: {m: failed(m) for m in ("bad-flag", "bad-gpus")}, seconds=6)
    for model in ("bad-flag", "bad-gpus"):
        counts = [int(s[model]["failures"]) for s in seen if s[model]]
        assert max(counts) <= 5, (model, counts)
        assert any(s[model] and s[model]["state"] == "backoff" for s in seen)
    # Validation refused them before launch: no engine was ever started.
    assert cluster.engine_pids() == []
