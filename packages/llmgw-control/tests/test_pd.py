"""Disaggregated profiles (issue 32 point 1): prefill and decode pools on one fabric.

The config's two pools, its errors naming the field, the reconciler placing both pools
on nodes sharing one value of the fabric label (and saying why, or why not), and
properties of the choice of that value.
"""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_control.catalog import Catalog, ModelConfig, build_catalog
from llmgw_control.config import load_control_config
from llmgw_control.inventory import Node, NodeState
from llmgw_control.pd_place import PoolNeed, choose_fabric
from llmgw_control.placement import Demand, GpuSlot, NodeView, Placement, Placer
from llmgw_control.reconciler import Settings, reconcile
from llmgw_control.records import ControlState, Start
from llmgw_proto import v1
from llmgw_proto.config import ConfigError
from llmgw_testkit import wait_for_async

GiB = 2**30
PORTS = (20000, 20099)
SETTINGS = Settings(
    port_range=PORTS,
    mgmt_interface="lo",
    base_backoff=1.0,
    max_backoff=8.0,
    drain_timeout=10.0,
    stop_grace=5.0,
    startup_grace=0.0,
    adopt_grace=30.0,
)
LABEL = "fabric.ib-subnet"


def pd_profile(**over: Any) -> dict[str, Any]:
    return {
        "engine": "vllm",
        "engine_args": ["--max-model-len", "8192"],
        "fabric_label": LABEL,
        "prefill": {"replicas": 2, "gpus_per_node": 1, "engine_args": ["--enforce-eager"]},
        "decode": {"replicas": {"min": 1, "max": 3}, "gpus_per_node": 2},
        **over,
    }


def build(profiles: dict[str, Any]) -> Catalog:
    models = msgspec.convert([{"name": "m", "profiles": profiles}], list[ModelConfig])
    return build_catalog(models, "control.yaml")


def test_a_profile_with_two_pools_becomes_two_catalog_profiles() -> None:
    cat = build({"pd": pd_profile()})
    prefill, decode = cat.get("m", "pd-prefill"), cat.get("m", "pd-decode")
    assert prefill is not None
    assert decode is not None
    assert cat.get("m", "pd") is None
    assert (prefill.role, prefill.pd_group, prefill.fabric_label) == ("prefill", "pd", LABEL)
    assert (decode.role, decode.pd_group, decode.fabric_label) == ("decode", "pd", LABEL)
    assert prefill.engine_args == ("--max-model-len", "8192", "--enforce-eager")
    assert decode.engine_args == ("--max-model-len", "8192")
    assert (prefill.replicas, prefill.min_replicas, prefill.max_replicas) == (2, 2, 2)
    assert (decode.min_replicas, decode.max_replicas) == (1, 3)
    assert (prefill.gpus_per_node, decode.gpus_per_node) == (1, 2)
    assert prefill.served_model_names == decode.served_model_names == ("m",)
    assert prefill.revision != decode.revision
    # An aggregated profile keeps its revision: the role is hashed only where there is one.
    plain = build({"p": {"engine": "vllm"}}).get("m", "p")
    assert plain is not None
    assert plain.role == ""


def write(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "control.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("profile", "field", "words"),
    [
        (pd_profile(decode=None), "profiles.pd.decode", "needs both pools"),
        (pd_profile(prefill=None), "profiles.pd.prefill", "needs both pools"),
        (pd_profile(fabric_label=""), "profiles.pd.fabric_label", "e.g. fabric.ib-subnet"),
        ({"engine": "vllm", "fabric_label": LABEL}, "profiles.pd.fabric_label", "disaggregated"),
        (pd_profile(engine="llamacpp"), "profiles.pd.engine", "use vllm or sglang"),
        (pd_profile(lora={}), "profiles.pd.lora", "LoRA"),
        (
            pd_profile(engine_args=["--kv-transfer-config={}"]),
            "profiles.pd.engine_args[0]",
            "--kv-transfer-config is set by the agent",
        ),
        (
            pd_profile(engine="sglang", decode={"engine_args": ["--disaggregation-mode", "x"]}),
            "profiles.pd.decode.engine_args[0]",
            "--disaggregation-mode is set by the agent",
        ),
        (pd_profile(decode={"engine_args": [""]}), "profiles.pd.decode.engine_args[0]", "empty"),
        (
            pd_profile(prefill={"replicas": {"min": 3, "max": 2}}),
            "profiles.pd.prefill.replicas",
            "min (3) must not exceed max (2)",
        ),
        (
            pd_profile(gpus_per_node=0, prefill={"nodes": 2}),
            "profiles.pd.prefill.nodes",
            "multi-node pool",
        ),
        (pd_profile(prefill={"gpus": 1}), "profiles.pd.prefill", "unknown field `gpus`"),
    ],
)
def test_pool_errors_name_the_field(
    tmp_path: Path, profile: dict[str, Any], field: str, words: str
) -> None:
    data = {"models": [{"name": "m", "profiles": {"pd": profile}}]}
    with pytest.raises(ConfigError) as info:
        load_control_config(write(tmp_path, data))
    message = str(info.value)
    assert message.startswith(str(tmp_path / "control.yaml") + ": $.models[0].")
    assert field in message
    assert words in message


def test_a_pool_name_taken_by_another_profile_is_refused(tmp_path: Path) -> None:
    data = {
        "models": [{"name": "m", "profiles": {"pd": pd_profile(), "pd-decode": {"engine": "vllm"}}}]
    }
    with pytest.raises(ConfigError) as info:
        load_control_config(write(tmp_path, data))
    assert "$.models[0].profiles.pd.decode" in str(info.value)
    assert "'pd-decode' is already defined" in str(info.value)


# --- the reconciler ---------------------------------------------------------------------


def make_node(node_id: str, gpus: int, value: str | None, address: str) -> Node:
    return Node(
        node_id,
        "s1",
        gpus=tuple(GpuSlot(i, "NVIDIA H100", 80 * GiB) for i in range(gpus)),
        interfaces={"lo": [address]},
        labels={LABEL: value} if value is not None else {},
    )


def run_pass(cat: Catalog, nodes: list[Node], state: ControlState | None = None) -> Any:
    ids = (f"m.x.{i:08x}" for i in itertools.count())
    return reconcile(
        cat,
        {n.node_id: n for n in nodes},
        state or ControlState(),
        100.0,
        SETTINGS,
        lambda m, p: next(ids),
    )


def test_both_pools_are_placed_on_one_fabric_the_roomiest_that_takes_them() -> None:
    cat = build({"pd": pd_profile(decode={"replicas": 2, "gpus_per_node": 2})})
    nodes = [
        make_node("a", 4, "ib-1", "10.0.0.1"),
        make_node("b", 4, "ib-1", "10.0.0.2"),
        make_node("c", 8, "ib-2", "10.0.0.3"),
        make_node("d", 8, "ib-2", "10.0.0.4"),
        make_node("e", 8, None, "10.0.0.5"),
    ]
    by_id = {n.node_id: n for n in nodes}
    decision = run_pass(cat, nodes)
    started = [c for c in decision.commands if isinstance(c, Start)]
    assert Counter(s.profile.name for s in started) == {"pd-prefill": 2, "pd-decode": 2}
    assert {by_id[s.node_id].labels[LABEL] for s in started} == {"ib-2"}
    for r in decision.state.replicas.values():
        assert f"{LABEL}=ib-2 takes 2 decode, 2 prefill replicas" in r.explanation
    # Scaled up later (another pass), the new replica joins the running ones' fabric even
    # where another value has more room now.
    bigger = build({"pd": pd_profile(decode={"replicas": 3, "gpus_per_node": 2})})
    nodes.append(make_node("f", 8, "ib-3", "10.0.0.6"))
    nodes.append(make_node("g", 8, "ib-3", "10.0.0.7"))
    again = run_pass(bigger, nodes, decision.state)
    new = [c for c in again.commands if isinstance(c, Start)]
    assert [s.profile.name for s in new] == ["pd-decode"]
    assert new[0].node_id in ("c", "d")


def test_when_no_fabric_takes_both_pools_it_says_what_each_took() -> None:
    cat = build({"pd": pd_profile(decode={"replicas": 2, "gpus_per_node": 2})})
    nodes = [make_node("a", 2, "ib-1", "10.0.0.1"), make_node("b", 4, "ib-2", "10.0.0.2")]
    decision = run_pass(cat, nodes)
    started = [c for c in decision.commands if isinstance(c, Start)]
    assert {s.node_id for s in started} == {"b"}  # the value that takes the most
    waiting = [r for r in decision.state.replicas.values() if not r.placed]
    assert waiting
    for r in waiting:
        assert "no value of fabric.ib-subnet takes 2 decode, 2 prefill replicas" in r.explanation
        assert "ib-1 takes 1 decode, 0 prefill; ib-2 takes 2 decode, 0 prefill" in r.explanation
        assert "is not on fabric.ib-subnet=ib-2, the pools' fabric (a)" in r.explanation


def test_no_node_with_the_label_is_said() -> None:
    cat = build({"pd": pd_profile()})
    decision = run_pass(cat, [make_node("a", 8, None, "10.0.0.1")])
    assert not [c for c in decision.commands if isinstance(c, Start)]
    for r in decision.state.replicas.values():
        assert "no node has label fabric.ib-subnet" in r.explanation
        assert "lacks label fabric.ib-subnet (a)" in r.explanation


# --- properties of the choice -------------------------------------------------------------


@st.composite
def fleets(draw: st.DrawFn) -> list[NodeView]:
    count = draw(st.integers(1, 6))
    out = []
    for i in range(count):
        gpus = draw(st.integers(0, 8))
        value = draw(st.sampled_from(["ib-1", "ib-2", "ib-3", None]))
        out.append(
            NodeView(
                f"n{i}",
                NodeState.READY,
                tuple(GpuSlot(j, "NVIDIA H100", 80 * GiB) for j in range(gpus)),
                labels={LABEL: value} if value else {},
                address=f"10.0.0.{i}",
                used_gpus=set(range(draw(st.integers(0, gpus)))),
            )
        )
    return out


@settings(max_examples=150, deadline=None)
@given(
    fleet=fleets(),
    gpus=st.integers(1, 4),
    n_prefill=st.integers(0, 4),
    n_decode=st.integers(0, 4),
)
def test_a_value_is_chosen_that_takes_both_pools_whenever_one_can(
    fleet: list[NodeView], gpus: int, n_prefill: int, n_decode: int
) -> None:
    demand = Demand(gpus_per_node=gpus, spread="node")
    pools = [PoolNeed("prefill", demand, n_prefill), PoolNeed("decode", demand, n_decode)]
    before = [(set(v.used_gpus), set(v.used_ports)) for v in fleet]
    value, why = choose_fabric(LABEL, pools, fleet, PORTS)
    assert before == [(v.used_gpus, v.used_ports) for v in fleet]  # pure
    # Reference for single-node pools of one size: a value's capacity in replicas.
    capacity: Counter[str] = Counter()
    for v in fleet:
        if LABEL in v.labels:
            capacity[v.labels[LABEL]] += (len(v.gpus) - len(v.used_gpus)) // gpus
    possible = any(c >= n_prefill + n_decode for c in capacity.values())
    if not capacity:
        assert value == ""
        assert "no node has label" in why
        return
    assert value in capacity
    assert ("takes" in why and "no value" not in why) == possible
    if possible:
        # Pinned to the value, every replica of both pools is placed there.
        pinned = Demand(gpus_per_node=gpus, spread="node", fabric=(LABEL, value))
        placer = Placer(fleet, PORTS)
        for _ in range(n_prefill + n_decode):
            result = placer.place(pinned)
            assert isinstance(result, Placement)
            assert all(
                next(v for v in fleet if v.node_id == s.node_id).labels[LABEL] == value
                for s in result.shards
            )


# --- a real control plane: StartShard and the endpoint snapshot --------------------------


async def test_pools_start_with_role_and_kv_port_and_endpoints_carry_them(
    control_factory: Any, agent_factory: Any, watcher_factory: Any
) -> None:
    """Real `llmgw-control serve`, scripted agents over gRPC, a router's Watch."""
    profile = pd_profile(
        prefill={"replicas": 1, "gpus_per_node": 1},
        decode={"replicas": 1, "gpus_per_node": 1},
    )
    control = control_factory([{"name": "m", "profiles": {"pd": profile}}])
    watcher = watcher_factory(control.grpc_port)
    # ib-2 has room for both pools (and more than ib-1): both land there, one node.
    other = agent_factory(control.grpc_port, "gpu-a", gpus=1, labels={LABEL: "ib-1"})
    agent = agent_factory(control.grpc_port, "gpu-b", gpus=4, labels={LABEL: "ib-2"})
    other.start()
    agent.start()

    async def both_started() -> list[v1.StartShard] | None:
        starts = agent.starts()
        return starts if len(starts) == 2 else None

    starts = await wait_for_async(both_started, timeout=60.0, what="both pools' StartShard")
    assert other.starts() == []
    by_role = {s.role: s for s in starts}
    assert set(by_role) == {"prefill", "decode"}
    assert by_role["prefill"].profile == "pd-prefill"
    ports = [p for s in starts for p in (s.port, s.kv_port)]
    assert all(21000 <= p <= 21099 for p in ports)
    assert len(set(ports)) == 4  # every engine and connector port its own

    snap = await watcher.until(lambda s: len(s.endpoints) == 2, "both endpoints published")
    roles = {e.profile: (e.role, e.kv_port) for e in snap.endpoints}
    assert roles == {
        "pd-prefill": ("prefill", by_role["prefill"].kv_port),
        "pd-decode": ("decode", by_role["decode"].kv_port),
    }
