from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from llmgw_agent.adapters import (
    LLAMACPP,
    SGLANG,
    VLLM,
    adapter_for,
    build_launch,
    reachability_problem,
)
from llmgw_agent.engine_flags import FlagSpec, Option, captured
from llmgw_proto import v1
from llmgw_proto.addr import parse_hostport

SPECS = {
    "vllm": captured("vllm", "0.32.0"),
    "sglang": captured("sglang", "0.5.23"),
    "llamacpp": captured("llamacpp", "b11434"),
}


def build(adapter: Any, start: v1.StartShard, command: list[str], **hosts: str) -> Any:
    parsed = SPECS[adapter.name].parse(start.engine_args)
    return build_launch(adapter, start, parsed, command, **hosts)


def launch(adapter: Any, start: v1.StartShard, command: list[str] | None = None) -> Any:
    return build(
        adapter, start, command or ["vllm"], bind_host="127.0.0.1", endpoint_host="10.0.0.5"
    )


def test_vllm_single_node(kit: Any) -> None:
    start = kit.make_start(
        gpu_indices=[2, 3],
        served_model_names=["qwen", "qwen-latest"],
        engine_args=["--max-model-len", "4096", "--enable-prefix-caching"],
        env={"HF_HOME": "/models"},
    )
    result = launch(VLLM, start, ["llmgw-sim", "vllm"])
    assert result.argv == [
        "llmgw-sim", "vllm",
        "serve", "Qwen/Qwen2.5-0.5B-Instruct",
        "--host", "127.0.0.1", "--port", "20001",
        "--tensor-parallel-size", "2",
        "--served-model-name", "qwen", "qwen-latest",
        "--max-model-len", "4096", "--enable-prefix-caching",
    ]  # fmt: skip
    assert result.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert result.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert result.env["HF_HOME"] == "/models"
    assert result.health_url == "http://127.0.0.1:20001/health"
    assert result.metrics_url == "http://127.0.0.1:20001/metrics"
    assert result.endpoint_url == "http://10.0.0.5:20001"
    assert not result.headless


def test_vllm_profile_parallelism_is_not_overridden(kit: Any) -> None:
    start = kit.make_start(gpu_indices=[0, 1, 2, 3], engine_args=["-tp", "2", "-pp", "2"])
    argv = launch(VLLM, start).argv
    assert "--tensor-parallel-size" not in argv
    assert "--pipeline-parallel-size" not in argv
    assert argv[-4:] == ["-tp", "2", "-pp", "2"]


def test_vllm_multi_node_leader_and_worker(kit: Any) -> None:
    multi = v1.MultiNode(rank=0, size=2, leader_address="10.0.0.5:29500")
    leader = launch(VLLM, kit.make_start(gpu_indices=list(range(8)), multi_node=multi))
    assert leader.argv[leader.argv.index("--tensor-parallel-size") + 1] == "8"
    assert leader.argv[leader.argv.index("--pipeline-parallel-size") + 1] == "2"
    tail = leader.argv[leader.argv.index("--nnodes") :]
    assert tail == [
        "--nnodes", "2", "--node-rank", "0",
        "--master-addr", "10.0.0.5", "--master-port", "29500",
        "--distributed-executor-backend", "mp",
    ]  # fmt: skip
    assert leader.endpoint_url == "http://10.0.0.5:20001"
    worker_multi = v1.MultiNode(rank=1, size=2, leader_address="10.0.0.5:29500")
    worker = launch(VLLM, kit.make_start(gpu_indices=list(range(8)), multi_node=worker_multi))
    assert worker.argv[worker.argv.index("--node-rank") + 1] == "1"
    assert worker.argv[-1] == "--headless"
    assert worker.headless
    assert worker.endpoint_url == ""


def test_sglang_single_and_multi_node(kit: Any) -> None:
    start = kit.make_start(
        engine=v1.EngineKind.SGLANG,
        gpu_indices=[0, 1],
        engine_args=["--mem-fraction-static", "0.8"],
    )
    result = launch(SGLANG, start, ["python", "-m", "sglang.launch_server"])
    assert result.argv == [
        "python", "-m", "sglang.launch_server",
        "--model-path", "Qwen/Qwen2.5-0.5B-Instruct",
        "--host", "127.0.0.1", "--port", "20001",
        "--tp-size", "2",
        "--served-model-name", "qwen",
        "--enable-metrics",
        "--mem-fraction-static", "0.8",
    ]  # fmt: skip
    assert result.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    multi = v1.MultiNode(rank=1, size=2, leader_address="10.0.0.5:29500")
    worker = launch(
        SGLANG, kit.make_start(engine=v1.EngineKind.SGLANG, gpu_indices=[0, 1], multi_node=multi)
    )
    # SGLang's tp size counts all nodes' GPUs.
    assert worker.argv[worker.argv.index("--tp-size") + 1] == "4"
    assert worker.argv[worker.argv.index("--nnodes") :] == [
        "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.5:29500",
    ]  # fmt: skip
    assert worker.headless


def test_llamacpp_cpu_only_and_gpu(kit: Any) -> None:
    cpu = kit.make_start(
        engine=v1.EngineKind.LLAMACPP,
        model_ref="/models/qwen.gguf",
        gpu_indices=[],
        cpu_threads=8,
        engine_args=["-c", "4096"],
    )
    result = launch(LLAMACPP, cpu, ["llama-server"])
    assert result.argv == [
        "llama-server",
        "-m", "/models/qwen.gguf",
        "--host", "127.0.0.1", "--port", "20001",
        "--alias", "qwen",
        "--threads", "8",
        "--metrics",
        "-c", "4096",
    ]  # fmt: skip
    # A CPU-only shard sees no GPU at all.
    assert result.env["CUDA_VISIBLE_DEVICES"] == ""
    gpu = launch(LLAMACPP, kit.make_start(engine=v1.EngineKind.LLAMACPP, gpu_indices=[1]))
    assert gpu.argv[gpu.argv.index("--n-gpu-layers") + 1] == "999"
    assert gpu.env["CUDA_VISIBLE_DEVICES"] == "1"


def test_served_name_defaults_to_model(kit: Any) -> None:
    result = launch(VLLM, kit.make_start(served_model_names=[]))
    assert result.argv[result.argv.index("--served-model-name") + 1] == "qwen"


def test_wildcard_bind_polls_loopback(kit: Any) -> None:
    result = build(VLLM, kit.make_start(), ["vllm"], bind_host="0.0.0.0", endpoint_host="node7")
    assert result.argv[result.argv.index("--host") + 1] == "0.0.0.0"
    assert result.health_url == "http://127.0.0.1:20001/health"
    assert result.endpoint_url == "http://node7:20001"
    v6 = build(VLLM, kit.make_start(), ["vllm"], bind_host="::", endpoint_host="fd00::2")
    assert v6.health_url == "http://[::1]:20001/health"
    assert v6.endpoint_url == "http://[fd00::2]:20001"


def test_adapter_knowledge() -> None:
    assert adapter_for(v1.EngineKind.UNSPECIFIED) is None
    assert VLLM.running_metric == "vllm:num_requests_running"
    assert SGLANG.running_metric == "sglang:num_running_reqs"
    assert LLAMACPP.running_metric == "llamacpp:requests_processing"
    assert {a.health_path for a in (VLLM, SGLANG, LLAMACPP)} == {"/health"}


def test_parse_forms() -> None:
    parsed = SPECS["vllm"].parse(
        [
            "--max_model_len=4096",
            "--no-enable-prefix-caching",
            "--seed",
            "-1",
            "--api-key",
            "a",
            "b",
            "-tp",
            "2",
        ]
    )
    assert parsed.errors == []
    assert parsed.values["--max-model-len"] == ["4096"]
    assert parsed.values["--enable-prefix-caching"] == ["false"]
    assert parsed.values["--seed"] == ["-1"]
    assert parsed.values["--api-key"] == ["a", "b"]
    assert parsed.values["--tensor-parallel-size"] == ["2"]
    bad = SPECS["vllm"].parse(["--max-modle-len", "4096", "--enforce-eager", "stray", "--dtype"])
    assert bad.errors == [
        "unknown engine argument '--max-modle-len'",
        "unexpected positional argument '4096'",
        "unexpected positional argument 'stray'",
        "engine argument '--dtype' needs a value",
    ]
    # SGLang has no --no-X negation and no underscore spelling.
    assert SPECS["sglang"].parse(["--no-enable-metrics"]).errors == [
        "unknown engine argument '--no-enable-metrics'"
    ]
    assert (
        SPECS["sglang"].parse(["--tp_size", "2"]).errors[0] == "unknown engine argument '--tp_size'"
    )


def test_leader_address_parsing() -> None:
    assert parse_hostport("10.0.0.5:29500") == ("10.0.0.5", 29500)
    assert parse_hostport("[fd00::2]:29500") == ("fd00::2", 29500)
    for bad in ("10.0.0.5", ":1", "h:0", "h:99999", "h:x"):
        with pytest.raises(ValueError, match="expected HOST:PORT"):
            parse_hostport(bad)


# (--dtype is left out: its value must be one of its choices.)
_VALUE_FLAGS = [
    "--max-model-len",
    "--max-num-seqs",
    "--seed",
    "--gpu-memory-utilization",
    "--block-size",
]
_SWITCHES = ["--enforce-eager", "--trust-remote-code", "--enable-prefix-caching"]


@given(
    st.lists(
        st.one_of(
            st.tuples(
                st.sampled_from(_VALUE_FLAGS), st.from_regex(r"[a-z0-9.]{1,8}", fullmatch=True)
            ),
            st.tuples(st.sampled_from(_SWITCHES)),
        ),
        max_size=6,
    ),
    st.integers(1, 8),
    st.integers(1, 4),
    st.booleans(),
)
def test_parallel_sizes_found_among_any_flags(
    others: list[tuple[str, ...]], tp: int, pp: int, equals_form: bool
) -> None:
    args: list[str] = [word for pair in others for word in pair]
    if equals_form:
        args += [f"--tensor-parallel-size={tp}", f"--pipeline-parallel-size={pp}"]
    else:
        args = ["-tp", str(tp), *args, "--pipeline-parallel-size", str(pp)]
    parsed = SPECS["vllm"].parse(args)
    assert parsed.errors == []
    start = v1.StartShard(engine=v1.EngineKind.VLLM, gpu_indices=[0])
    assert VLLM.parallel_sizes(start, parsed) == (tp, pp)


@given(st.lists(st.sampled_from(["--alpha", "--beta", "-x", "value", "--gamma=1"]), max_size=8))
def test_parser_never_raises_and_accounts_for_every_token(tokens: list[str]) -> None:
    spec = FlagSpec("sglang", "", (Option(("--alpha",), 1, 1), Option(("--beta", "-x"), 0, 0)))
    parsed = spec.parse(tokens)
    # Every token is either read as a flag/value or named in an error.
    assert all(isinstance(e, str) and e for e in parsed.errors)
    assert set(parsed.values) <= {"--alpha", "--beta"}


def test_endpoint_reachability_is_checked(kit: Any) -> None:
    # Loopback bind, other address advertised: nobody else can reach the engine.
    loop = launch(VLLM, kit.make_start())
    assert "binds 127.0.0.1 (loopback) but is advertised at 10.0.0.5" in loop.endpoint_warning
    wide = build(VLLM, kit.make_start(), ["vllm"], bind_host="0.0.0.0", endpoint_host="node7")
    assert wide.endpoint_warning == ""
    assert "where it does not listen" in reachability_problem("10.0.0.5", "127.0.0.1")
    assert reachability_problem("127.0.0.1", "localhost") == ""
    assert reachability_problem("10.0.0.5", "10.0.0.5") == ""
