"""`llmgw-control check --config FILE --admin ADDR` judges engine_args against the flags
the agents report (issue 29 point 9): a real control plane and a real agent (its vLLM
simulated, with the captured vLLM 0.32.0 help), the check a separate process."""

from __future__ import annotations

import subprocess

from llmgw_testkit.cluster import Cluster, bin_path, vllm_profile


def test_check_refuses_a_flag_the_nodes_engine_does_not_accept(cluster: Cluster) -> None:
    cluster.start_control([])
    cluster.start_agent("gpu-a", gpus=2)
    cluster.wait_node_state("gpu-a", "READY", timeout=120)
    flags = cluster.admin("/v1/engine-flags")
    (node,) = flags["nodes"]
    (vllm,) = [e for e in node["engines"] if e["kind"] == "vllm"]
    assert vllm["flags_listed"], vllm
    assert "--max-model-len" in vllm["value_flags"]

    def check(args: list[str], name: str) -> subprocess.CompletedProcess[str]:
        profile = vllm_profile(gpus=1, args=args)
        config = cluster.write(
            name, cluster.control_config([{"name": "chat", "profiles": {"p": profile}}])
        )
        return subprocess.run(
            [bin_path("llmgw-control"), "check", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=120,
            env={"LLMGW_ADMIN": f"127.0.0.1:{cluster.admin_port}", "PATH": "/usr/bin:/bin"},
        )

    good = check(["--max-model-len", "2048", "--enforce-eager", "-tp", "1"], "good.yaml")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "nothing wrong found" in good.stdout

    bad = check(["--max-model-len", "2048", "--no-such-flag", "3"], "bad.yaml")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert (
        "models[chat].profiles.p.engine_args: '--no-such-flag' is not a flag vllm 0.32.0 "
        "accepts (node gpu-a)"
    ) in bad.stdout, bad.stdout
    assert "Traceback" not in bad.stderr
