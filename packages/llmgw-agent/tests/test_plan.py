"""plan(): one pure step from a StartShard to a launch or its problems; model-file checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from llmgw_agent.config import AgentConfig
from llmgw_agent.engine_flags import captured
from llmgw_agent.engines import InstalledEngine
from llmgw_agent.plan import Plan, Refused, plan
from llmgw_agent.validation import NodeView, Probes, version_problems
from llmgw_proto import v1
from llmgw_proto.config import convert

GIB = 1024**3
VLLM_SPEC = captured("vllm", "0.32.0")
ENGINES = {
    "vllm": InstalledEngine("vllm", "/usr/bin/vllm", "0.32.0", VLLM_SPEC),
    "sglang": InstalledEngine("sglang", "/usr/bin/python", error="`python -m ...` exited 1"),
}
CONFIG = convert(
    {
        "control": {"tls": {"insecure": True}},
        "engine_host": "0.0.0.0",
        "advertise_host": "10.0.0.5",
    },
    AgentConfig,
    source="agent.yaml",
)


def files(tree: dict[str, str | int]) -> Probes:
    """Probes over a made-up file tree: path -> text, or path -> size in bytes."""

    def read_text(path: str) -> str | None:
        value = tree.get(path)
        return value if isinstance(value, str) else None

    def file_sizes(path: str) -> dict[str, int]:
        prefix = path.rstrip("/") + "/"
        out = {k[len(prefix) :]: v for k, v in tree.items() if k.startswith(prefix)}
        sizes = {k: v if isinstance(v, int) else len(v) for k, v in out.items() if "/" not in k}
        if path in tree:
            value = tree[path]
            sizes[Path(path).name] = value if isinstance(value, int) else len(value)
        return sizes

    return Probes(
        which=lambda name: f"/usr/bin/{name}",
        port_free=lambda h, p: True,
        path_exists=lambda p: p in tree or any(k.startswith(p.rstrip("/") + "/") for k in tree),
        read_text=read_text,
        file_sizes=file_sizes,
    )


def node(free: int = 80 * GIB, total: int = 80 * GIB) -> NodeView:
    return NodeView(
        gpus=dict.fromkeys(range(4), False),
        simulated=False,
        engines=ENGINES,
        gpu_memory=dict.fromkeys(range(4), (total, free)),
    )


def test_a_valid_start_plans_its_launch(kit: Any) -> None:
    decided = plan(kit.make_start(gpu_indices=[0, 1]), CONFIG, node(), files({}))
    assert isinstance(decided, Plan)
    assert decided.launch.argv[:4] == ["vllm", "serve", "Qwen/Qwen2.5-0.5B-Instruct", "--host"]
    assert decided.launch.endpoint_url == "http://10.0.0.5:20001"
    assert decided.launch.endpoint_warning == ""
    assert decided.parsed.spec is VLLM_SPEC
    assert decided.load_timeout == CONFIG.load_timeout


def test_kv_events_published_off_the_node_are_refused(kit: Any) -> None:
    raw = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://192.0.2.1:5557"})
    start = kit.make_start(engine_args=["--kv-events-config", raw])
    decided = plan(start, CONFIG, node(), files({}))
    assert isinstance(decided, Refused)
    assert any("--kv-events-config" in p and "192.0.2.1" in p for p in decided.problems)


def test_refused_with_every_problem_and_the_launch_it_would_have_been(kit: Any) -> None:
    start = kit.make_start(gpu_indices=[9], engine_args=["--swap-space", "4"])
    decided = plan(start, CONFIG, node(), files({}))
    assert isinstance(decided, Refused)
    assert "engine_args: unknown engine argument '--swap-space' for vllm" in decided.problems
    assert any("GPU 9 does not exist" in p for p in decided.problems)
    assert decided.launch is not None


def test_an_unusable_engine_refuses_its_profiles_with_the_reason(kit: Any) -> None:
    start = kit.make_start(engine=v1.EngineKind.SGLANG)
    decided = plan(start, CONFIG, node(), files({}))
    assert isinstance(decided, Refused)
    assert decided.problems == ["sglang cannot be used on this node: `python -m ...` exited 1"]
    assert decided.launch is None


def test_max_model_len_against_the_models_config(kit: Any) -> None:
    tree: dict[str, str | int] = {
        "/models/q/config.json": json.dumps({"max_position_embeddings": 32768}),
        "/models/q/model.safetensors": 2 * GIB,
    }
    ok = kit.make_start(model_ref="/models/q", engine_args=["--max-model-len", "32k"])
    assert isinstance(plan(ok, CONFIG, node(), files(tree)), Plan)
    long = kit.make_start(model_ref="/models/q", engine_args=["--max-model-len", "64K"])
    decided = plan(long, CONFIG, node(), files(tree))
    assert isinstance(decided, Refused)
    assert decided.problems == [
        "engine_args: --max-model-len 64K (65536 tokens) is more than the model allows: "
        "32768 tokens (max_position_embeddings in /models/q/config.json)"
    ]


def test_weights_against_gpu_memory_with_the_arithmetic(kit: Any) -> None:
    tree: dict[str, str | int] = {
        "/models/big/config.json": "{}",
        "/models/big/model.safetensors.index.json": json.dumps(
            {"metadata": {"total_size": 140 * GIB}}
        ),
    }
    start = kit.make_start(model_ref="/models/big", gpu_indices=[0, 1])
    # 70 GiB per GPU fits in 0.9 x 80 GiB.
    assert isinstance(plan(start, CONFIG, node(), files(tree)), Plan)
    half = kit.make_start(
        model_ref="/models/big", gpu_indices=[0, 1], engine_args=["--gpu-memory-utilization", "0.5"]
    )
    decided = plan(half, CONFIG, node(), files(tree))
    assert isinstance(decided, Refused)
    assert decided.problems == [
        "the weights (140.0 GiB) over 2 GPUs need 70.0 GiB per GPU, but a GPU gives the "
        "engine at most 40.0 GiB (--gpu-memory-utilization 0.5 x 80.0 GiB = 40.0 GiB, "
        "80.0 GiB free), before any KV cache"
    ]
    # Memory another process holds counts too.
    busy = plan(start, CONFIG, node(free=50 * GIB), files(tree))
    assert isinstance(busy, Refused)
    assert "at most 50.0 GiB" in busy.problems[0]
    assert "50.0 GiB free" in busy.problems[0]
    # A GGUF file is measured by its size.
    gguf: dict[str, str | int] = {"/models/m.gguf": 100 * GIB}
    one = kit.make_start(model_ref="/models/m.gguf", gpu_indices=[0])
    refused = plan(one, CONFIG, node(), files(gguf))
    assert isinstance(refused, Refused)
    assert refused.problems[0].startswith("the weights (100.0 GiB) over 1 GPUs need 100.0 GiB")


@given(st.lists(st.sampled_from(["--max-model-len", "8", "-tp", "2", "--bogus", "x", "-O3"])))
def test_plan_never_raises(args: list[str]) -> None:
    start = v1.StartShard(
        shard_id="s-0", engine=v1.EngineKind.VLLM, model_ref="m", port=20001,
        gpu_indices=[0, 1], engine_args=args,
    )  # fmt: skip
    decided = plan(start, CONFIG, node(), files({}))
    assert isinstance(decided, Plan | Refused)
    if isinstance(decided, Refused):
        assert decided.problems
        assert all(p for p in decided.problems)


def test_engine_version_requirement(kit: Any) -> None:
    ok = kit.make_start(engine_version=">=0.30,<0.33")
    assert isinstance(plan(ok, CONFIG, node(), files({})), Plan)
    new = kit.make_start(engine_version=">=0.33")
    decided = plan(new, CONFIG, node(), files({}))
    assert isinstance(decided, Refused)
    assert decided.problems == ["engine_version '>=0.33': this node has vllm 0.32.0"]
    bad = plan(kit.make_start(engine_version="recent"), CONFIG, node(), files({}))
    assert isinstance(bad, Refused)
    assert "is not a version or a comparison like >=0.30" in bad.problems[0]


@given(
    st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(0, 5)),
    st.tuples(st.integers(0, 3), st.integers(0, 40)),
)
def test_version_bounds_agree_with_tuple_order(
    have: tuple[int, int, int], bound: tuple[int, int]
) -> None:
    text = ".".join(map(str, have))
    wanted = ".".join(map(str, bound))
    at_least = version_problems("vllm", f">={wanted}", text) == []
    below = version_problems("vllm", f"<{wanted}", text) == []
    assert at_least == (have >= (*bound, 0))
    assert at_least != below
