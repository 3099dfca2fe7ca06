"""A disaggregated pool's engine launched with its KV connector (issue 32 point 2).

The flags are the installed engine's own (the captured help), the ports placement's,
the RDMA devices the node's; plan() refuses a role the engine cannot run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from llmgw_agent.adapters import SGLANG, VLLM, build_launch
from llmgw_agent.config import AgentConfig
from llmgw_agent.disagg import rdma_devices, role_problems
from llmgw_agent.engine_flags import FlagSpec, Option, captured
from llmgw_agent.engines import InstalledEngine
from llmgw_agent.plan import Plan, Refused, plan
from llmgw_agent.validation import NodeView, Probes
from llmgw_proto import v1
from llmgw_proto.config import convert

CONFIG = convert(
    {
        "control": {"tls": {"insecure": True}},
        "engine_host": "0.0.0.0",
        "advertise_host": "10.0.0.5",
    },
    AgentConfig,
    source="agent.yaml",
)

VLLM_SPEC = captured("vllm", "0.32.0")
SGLANG_SPEC = captured("sglang", "0.5.23")


def node(rdma: tuple[str, ...] = ()) -> NodeView:
    return NodeView(
        gpus=dict.fromkeys(range(4), False),
        simulated=False,
        engines={
            "vllm": InstalledEngine("vllm", "/usr/bin/vllm", "0.32.0", VLLM_SPEC),
            "sglang": InstalledEngine("sglang", "/usr/bin/python", "0.5.23", SGLANG_SPEC),
        },
        rdma_devices=rdma,
    )


def probes() -> Probes:
    return Probes(
        which=lambda name: f"/usr/bin/{name}",
        port_free=lambda h, p: True,
        path_exists=lambda p: False,
        read_text=lambda p: None,
        file_sizes=lambda p: {},
    )


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_vllm_prefill_and_decode_get_the_nixl_connector_and_side_channel(kit: Any) -> None:
    for role in ("prefill", "decode"):
        start = kit.make_start(role=role, kv_port=20007)
        decided = plan(start, CONFIG, node(), probes())
        assert isinstance(decided, Plan), decided
        argv, env = decided.launch.argv, decided.launch.env
        config = json.loads(flag_value(argv, "--kv-transfer-config"))
        kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
        assert config == {"kv_connector": "NixlConnector", "kv_role": kv_role}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.5"  # the endpoint host
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "20007"
        # The installed vLLM reads the whole command line as it is.
        assert VLLM_SPEC.parse(argv[argv.index("--host") :]).errors == []


def test_an_aggregated_start_gets_no_connector(kit: Any) -> None:
    decided = plan(kit.make_start(), CONFIG, node(("mlx5_0",)), probes())
    assert isinstance(decided, Plan)
    assert "--kv-transfer-config" not in decided.launch.argv
    assert not any(k.startswith("VLLM_NIXL") for k in decided.launch.env)


def test_sglang_roles_bootstrap_port_backend_and_rdma_devices(kit: Any) -> None:
    prefill = kit.make_start(engine=v1.EngineKind.SGLANG, role="prefill", kv_port=20009)
    decided = plan(prefill, CONFIG, node(("mlx5_0", "mlx5_1")), probes())
    assert isinstance(decided, Plan), decided
    argv = decided.launch.argv
    assert flag_value(argv, "--disaggregation-mode") == "prefill"
    assert flag_value(argv, "--disaggregation-bootstrap-port") == "20009"
    assert flag_value(argv, "--disaggregation-transfer-backend") == "mooncake"
    assert flag_value(argv, "--disaggregation-ib-device") == "mlx5_0,mlx5_1"
    assert SGLANG_SPEC.parse(argv[argv.index("--model-path") :]).errors == []
    # A decode engine runs no bootstrap server; the profile's backend and devices win.
    decode = kit.make_start(
        engine=v1.EngineKind.SGLANG,
        role="decode",
        kv_port=20010,
        engine_args=["--disaggregation-transfer-backend", "nixl"],
    )
    decided = plan(decode, CONFIG, node(), probes())
    assert isinstance(decided, Plan), decided
    argv = decided.launch.argv
    assert flag_value(argv, "--disaggregation-mode") == "decode"
    assert "--disaggregation-bootstrap-port" not in argv
    assert argv.count("--disaggregation-transfer-backend") == 1
    assert flag_value(argv, "--disaggregation-transfer-backend") == "nixl"
    assert "--disaggregation-ib-device" not in argv  # the node has no RDMA devices


def test_roles_the_engine_cannot_run_are_refused_naming_why(kit: Any) -> None:
    cases = [
        (kit.make_start(role="both", kv_port=1), "role 'both' is not prefill or decode"),
        (kit.make_start(role="decode"), "a decode engine needs kv_port"),
        (
            kit.make_start(engine=v1.EngineKind.LLAMACPP, role="prefill", kv_port=1),
            "llamacpp has no prefill/decode disaggregation",
        ),
    ]
    for start, words in cases:
        decided = plan(start, CONFIG, node(), probes())
        assert isinstance(decided, Refused)
        assert any(words in p for p in decided.problems), decided.problems
    # An engine whose flags lack the connector's (an older release) cannot run a pool.
    old = FlagSpec("vllm", "0.5.0", (Option(("--host",), 1, 1), Option(("--port",), 1, 1)))
    problems = role_problems(kit.make_start(role="prefill", kv_port=1), "vllm", old.parse([]))
    assert problems == [
        "the installed vllm 0.5.0 does not accept --kv-transfer-config: "
        "it cannot run a prefill engine"
    ]


def test_rdma_devices_are_read_from_sysfs(tmp_path: Path) -> None:
    assert rdma_devices(tmp_path / "missing") == ()
    for name in ("mlx5_1", "mlx5_0"):
        (tmp_path / name).mkdir()
    assert rdma_devices(tmp_path) == ("mlx5_0", "mlx5_1")


@given(
    role=st.sampled_from(["prefill", "decode"]),
    engine=st.sampled_from(["vllm", "sglang"]),
    port=st.integers(1, 65535),
    rdma=st.lists(st.from_regex(r"mlx5_[0-9]{1,2}", fullmatch=True), max_size=3, unique=True),
)
def test_the_connector_flags_appear_once_and_parse(
    role: str, engine: str, port: int, rdma: list[str]
) -> None:
    adapter, spec = (VLLM, VLLM_SPEC) if engine == "vllm" else (SGLANG, SGLANG_SPEC)
    start = v1.StartShard(
        shard_id="m.p-prefill.1-0",
        model="m",
        model_ref="m",
        engine=v1.EngineKind.VLLM if engine == "vllm" else v1.EngineKind.SGLANG,
        port=20001,
        gpu_indices=[0],
        served_model_names=["m"],
        role=role,
        kv_port=port,
    )
    launch = build_launch(
        adapter,
        start,
        spec.parse([]),
        [engine],
        bind_host="127.0.0.1",
        endpoint_host="10.0.0.5",
        rdma=rdma,
    )
    argv = launch.argv[1:]
    parsed = spec.parse(argv[2:] if engine == "vllm" else argv)
    assert parsed.errors == []
    if engine == "vllm":
        assert argv.count("--kv-transfer-config") == 1
        assert launch.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(port)
    else:
        assert parsed.first("--disaggregation-mode") == role
        assert (parsed.first("--disaggregation-bootstrap-port") == str(port)) == (role == "prefill")
        assert parsed.first("--disaggregation-ib-device") == (",".join(rdma) or None)
