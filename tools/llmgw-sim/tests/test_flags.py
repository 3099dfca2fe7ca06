"""The engines' flag tables: names, types and defaults as the real engines have them."""

from __future__ import annotations

import argparse

import pytest
from llmgw_sim.flags import human_readable_int, known_flags, parse_engine_args

# What llmgw's vLLM adapter emits, plus the common flags the issue lists.
VLLM_REQUIRED = {
    "--host", "--port", "--served-model-name", "--tensor-parallel-size",
    "--pipeline-parallel-size", "--data-parallel-size", "--gpu-memory-utilization",
    "--max-model-len", "--max-num-seqs", "--dtype", "--quantization",
    "--enable-prefix-caching", "--no-enable-prefix-caching", "--api-key", "--nnodes",
    "--node-rank", "--master-addr", "--master-port", "--headless",
    "--distributed-executor-backend", "--trust-remote-code", "--seed", "-tp", "-pp", "-dp",
}  # fmt: skip
SGLANG_REQUIRED = {
    "--model-path", "--host", "--port", "--tp-size", "--tensor-parallel-size", "--dp-size",
    "--mem-fraction-static", "--max-running-requests", "--context-length", "--api-key",
    "--served-model-name", "--enable-metrics", "--nnodes", "--node-rank", "--dist-init-addr",
    "--trust-remote-code", "--random-seed", "--disable-radix-cache",
}  # fmt: skip
LLAMA_REQUIRED = {
    "-m", "--model", "--host", "--port", "-c", "--ctx-size", "-t", "--threads", "-a",
    "--alias", "--metrics", "-np", "--parallel", "-ngl", "--n-gpu-layers", "--api-key",
    "--embeddings", "-fa", "--jinja",
}  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "required"),
    [("vllm", VLLM_REQUIRED), ("sglang", SGLANG_REQUIRED), ("llama-server", LLAMA_REQUIRED)],
)
def test_known_flags_cover_what_llmgw_emits(kind: str, required: set[str]) -> None:
    flags = known_flags(kind)  # type: ignore[arg-type]
    assert required <= flags, sorted(required - flags)
    assert not any(f.startswith("--sim-") for f in flags)


def test_known_flags_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown engine kind"):
        known_flags("tgi")  # type: ignore[arg-type]


def test_vllm_defaults_match_vllm() -> None:
    ns = parse_engine_args("vllm", ["org/model"])
    assert ns.model_tag == "org/model"
    assert ns.port == 8000
    assert ns.host is None
    assert ns.tensor_parallel_size == 1
    assert ns.gpu_memory_utilization == 0.9
    assert ns.enable_prefix_caching is None
    assert ns.master_port == 29501
    assert ns.headless is False


def test_vllm_types_aliases_and_underscores() -> None:
    ns = parse_engine_args(
        "vllm",
        [
            "m", "-tp", "4", "--pipeline_parallel_size=2", "--max-model-len", "32k",
            "--no-enable-prefix-caching", "--served-model-name", "a", "b", "--api-key", "k1",
            "--gpu-memory-utilization", "0.5", "--headless", "--nnodes", "2", "--node-rank", "1",
        ],
    )  # fmt: skip
    assert ns.tensor_parallel_size == 4
    assert ns.pipeline_parallel_size == 2
    assert ns.max_model_len == 32000
    assert ns.enable_prefix_caching is False
    assert ns.served_model_name == ["a", "b"]
    assert ns.api_key == ["k1"]
    assert ns.gpu_memory_utilization == 0.5
    assert (ns.headless, ns.nnodes, ns.node_rank) == (True, 2, 1)


def test_unknown_vllm_flag_exits_2_with_argparse_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_engine_args("vllm", ["m", "--not-a-flag", "1"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --not-a-flag 1" in capsys.readouterr().err


def test_bad_type_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_engine_args("vllm", ["m", "--tensor-parallel-size", "two"])
    assert exc.value.code == 2
    assert "--tensor-parallel-size" in capsys.readouterr().err


def test_sglang_requires_model_path(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_engine_args("sglang", ["--port", "1"])
    assert exc.value.code == 2
    assert "--model-path" in capsys.readouterr().err
    ns = parse_engine_args("sglang", ["--model-path", "m", "--tp-size", "2"])
    assert (ns.model_path, ns.tensor_parallel_size, ns.port, ns.host) == (
        "m",
        2,
        30000,
        "127.0.0.1",
    )


def test_llama_server_flags_and_unknown_flag(capsys: pytest.CaptureFixture[str]) -> None:
    ns = parse_engine_args(
        "llama-server", ["-m", "/m.gguf", "-c", "8192", "-t", "4", "--alias", "x", "--metrics"]
    )
    assert (ns.model, ns.ctx_size, ns.threads, ns.alias, ns.metrics) == (
        "/m.gguf", 8192, 4, "x", True,
    )  # fmt: skip
    assert ns.port == 8080
    with pytest.raises(SystemExit) as exc:
        parse_engine_args("llama-server", ["-m", "x", "--bogus"])
    assert exc.value.code == 1
    assert "error: invalid argument: --bogus" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "value"), [("4096", 4096), ("32k", 32000), ("32K", 32768), ("1M", 2**20)]
)
def test_human_readable_int(text: str, value: int) -> None:
    assert human_readable_int(text) == value


def test_human_readable_int_rejects_garbage() -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        human_readable_int("lots")
