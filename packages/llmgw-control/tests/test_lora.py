"""LoRA adapters in the control plane (issue 30): the catalog's checks and flags, and the
pure decision of which replica loads or unloads which adapter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_control.config import load_control_config
from llmgw_control.lora_plan import Action, Demand, ReplicaView, plan
from llmgw_proto.config import ConfigError


def write(tmp_path: Path, models: list[dict[str, Any]]) -> Path:
    path = tmp_path / "control.yaml"
    path.write_text(yaml.safe_dump({"models": models}))
    return path


def base(engine: str = "vllm", **lora: Any) -> dict[str, Any]:
    return {
        "name": "gemma",
        "profiles": {"default": {"engine": engine, "lora": lora or {"max_loras": 2}}},
        "adapters": [{"name": "sql", "source": "/models/sql"}, {"name": "chat", "source": "hub/c"}],
    }


# --- catalog -------------------------------------------------------------------------


def test_adapters_and_engine_flags(tmp_path: Path) -> None:
    catalog = load_control_config(write(tmp_path, [base(max_loras=3, max_rank=32)])).catalog
    assert [(a.model, a.name, a.source) for a in catalog.adapters] == [
        ("gemma", "sql", "/models/sql"),
        ("gemma", "chat", "hub/c"),
    ]
    assert catalog.adapter("sql") is not None
    assert catalog.adapter("gemma") is None
    p = catalog.profiles[0]
    assert p.max_loras == 3
    assert p.lora_min_idle == 10.0
    assert p.engine_args[-5:] == ("--enable-lora", "--max-loras", "3", "--max-lora-rank", "32")
    assert ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True") in p.env
    sg = load_control_config(write(tmp_path, [base("sglang", max_loras=2)])).catalog.profiles[0]
    assert sg.engine_args[:5] == (
        "--enable-lora",
        "--max-loras-per-batch",
        "2",
        "--max-lora-rank",
        "16",
    )


def test_adapter_changes_do_not_roll_replicas(tmp_path: Path) -> None:
    one = load_control_config(write(tmp_path, [base()])).catalog
    model = base()
    model["adapters"] = model["adapters"][:1]
    two = load_control_config(write(tmp_path, [model])).catalog
    assert one.profiles[0].revision == two.profiles[0].revision
    assert [a.name for a in two.adapters] == ["sql"]


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        (
            lambda m: m["adapters"].append({"name": "sql", "source": "x"}),
            "adapters[2].name",
            "already listed",
        ),
        (
            lambda m: m["adapters"].append({"name": "gemma", "source": "x"}),
            "adapters[2].name",
            "already taken",
        ),
        (
            lambda m: m["adapters"].append({"name": "bad name", "source": "x"}),
            "adapters[2].name",
            "no spaces",
        ),
        (
            lambda m: m["adapters"].append({"name": "n", "source": " "}),
            "adapters[2].source",
            "needs a source",
        ),
        (lambda m: m["profiles"]["default"].pop("lora"), "$.models[0].adapters", "sets lora"),
        (lambda m: m["profiles"]["default"]["lora"].update(max_rank=12), "lora.max_rank", "one of"),
        (
            lambda m: m["profiles"]["default"].update(engine="llamacpp"),
            "default.lora",
            "llama-server",
        ),
        (lambda m: m["profiles"]["default"]["lora"].update(max_loras=0), "max_loras", ""),
        (
            lambda m: m["profiles"]["default"]["lora"].update(min_idle="-1s"),
            "lora.min_idle",
            "a duration",
        ),
    ],
)
def test_adapter_errors_name_the_field(tmp_path: Path, change: Any, field: str, words: str) -> None:
    model = base()
    change(model)
    with pytest.raises(ConfigError) as info:
        load_control_config(write(tmp_path, [model]))
    text = str(info.value)
    assert field in text, text
    assert words in text, text


def test_an_sglang_served_adapter_has_no_colon_in_its_name(tmp_path: Path) -> None:
    # SGLang reads a request's model "base:adapter" as the adapter after the ':'.
    model = base("sglang")
    model["adapters"].append({"name": "team:sql", "source": "/models/t"})
    with pytest.raises(ConfigError) as info:
        load_control_config(write(tmp_path, [model]))
    assert "$.models[0].adapters[2].name" in str(info.value)
    assert "SGLang reads" in str(info.value)
    # vLLM takes the name whole.
    model = base("vllm")
    model["adapters"].append({"name": "team:sql", "source": "/models/t"})
    catalog = load_control_config(write(tmp_path, [model])).catalog
    assert catalog.adapter("team:sql") is not None


def test_adapter_name_clashing_with_another_models_served_name(tmp_path: Path) -> None:
    other = {"name": "sql", "profiles": {"default": {"engine": "vllm"}}}
    with pytest.raises(ConfigError) as info:
        load_control_config(write(tmp_path, [base(), other]))
    assert "$.models[0].adapters[0].name" in str(info.value)
    assert "served model name of model 'sql'" in str(info.value)


# --- the decision --------------------------------------------------------------------


def test_held_adapter_loads_on_the_least_loaded_replica() -> None:
    reps = [ReplicaView("a", 5, 2), ReplicaView("b", 1, 2), ReplicaView("c", 3, 2)]
    assert plan(reps, {"x": Demand(held=2, last_used=1)}) == [Action("load", "b", "x")]


def test_full_replica_unloads_its_least_recently_used() -> None:
    reps = [ReplicaView("a", 0, 2, frozenset({"old", "new"}))]
    demand = {
        "old": Demand(last_used=1),
        "new": Demand(last_used=9),
        "x": Demand(held=1, last_used=10),
    }
    assert plan(reps, demand) == [Action("unload", "a", "old"), Action("load", "a", "x")]


def test_every_replica_full_evicts_the_fleets_least_recently_used() -> None:
    reps = [
        ReplicaView("a", 0, 1, frozenset({"warm"})),
        ReplicaView("b", 9, 1, frozenset({"cold"})),
    ]
    demand = {"warm": Demand(last_used=50), "cold": Demand(last_used=10), "x": Demand(held=1)}
    assert plan(reps, demand) == [Action("unload", "b", "cold"), Action("load", "b", "x")]


def test_a_busy_adapter_outlives_a_rarely_used_one_used_last() -> None:
    reps = [ReplicaView("a", 0, 2, frozenset({"busy", "rare"}))]
    demand = {
        "busy": Demand(rate=3.0, last_used=40),
        "rare": Demand(rate=0.1, last_used=50),
        "x": Demand(held=1, last_used=60),
    }
    assert plan(reps, demand) == [Action("unload", "a", "rare"), Action("load", "a", "x")]


def test_held_adapter_already_held_or_loading_is_left_alone() -> None:
    reps = [
        ReplicaView("a", 0, 2, frozenset({"x"})),
        ReplicaView("b", 0, 2, loading=frozenset({"y"})),
    ]
    assert plan(reps, {"x": Demand(held=3), "y": Demand(held=1)}) == []


def test_hot_adapter_gains_a_holder_not_a_cold_one() -> None:
    reps = [ReplicaView("a", 9, 2, frozenset({"hot"})), ReplicaView("b", 0, 2)]
    assert plan(reps, {"hot": Demand(rate=20, last_used=5)}, hot_rate=8) == [
        Action("load", "b", "hot")
    ]
    assert plan(reps, {"hot": Demand(rate=4, last_used=5)}, hot_rate=8) == []


def test_nothing_to_evict_when_every_slot_is_loading_or_wanted() -> None:
    reps = [ReplicaView("a", 0, 1, frozenset({"w"}))]
    assert plan(reps, {"w": Demand(held=1), "x": Demand(held=1)}) == []


names = st.sampled_from([f"l{i}" for i in range(8)])
replica = st.builds(
    lambda i, load, cap, held, loading: ReplicaView(
        f"r{i}",
        load,
        cap,
        frozenset(list(held)[:cap]),
        frozenset(list(loading - held)[: max(0, cap - min(cap, len(held)))]),
    ),
    st.integers(0, 5),
    st.floats(0, 50),
    st.integers(0, 4),
    st.frozensets(names, max_size=5),
    st.frozensets(names, max_size=3),
)
demand = st.dictionaries(
    names,
    st.builds(Demand, st.integers(0, 5), st.floats(0, 40), st.floats(0, 100)),
    max_size=8,
)


def _unique(reps: list[ReplicaView]) -> list[ReplicaView]:
    return list({r.id: r for r in reps}.values())


def test_an_adapter_used_recently_is_not_unloaded_for_another() -> None:
    reps = [ReplicaView("a", 0, 1, frozenset({"busy"}))]
    demand = {"busy": Demand(last_used=95), "x": Demand(held=1, last_used=100)}
    assert plan(reps, demand, now=100, min_idle=10) == []
    assert plan(reps, demand, now=106, min_idle=10) == [
        Action("unload", "a", "busy"),
        Action("load", "a", "x"),
    ]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(replica, max_size=5).map(_unique),
    demand,
    st.floats(0.5, 20),
    st.floats(0, 120),
    st.sampled_from([0.0, 5.0, 30.0]),
)
def test_plan_properties(
    reps: list[ReplicaView], wants: dict[str, Demand], hot: float, now: float, min_idle: float
) -> None:
    actions = plan(reps, wants, hot_rate=hot, now=now, min_idle=min_idle)
    taken = {r.id: set(r.taken) for r in reps}
    by_id = {r.id: r for r in reps}
    for a in actions:
        r = by_id[a.replica]
        if a.kind == "load":
            # Never a load where the adapter is held or on its way.
            assert a.adapter not in taken[a.replica]
            taken[a.replica].add(a.adapter)
        else:
            # Never an unload of one being loaded, nor of one with requests held.
            assert a.adapter in taken[a.replica]
            assert a.adapter not in r.loading
            assert wants.get(a.adapter, Demand()).held == 0
            # Nor of one used within min_idle.
            assert min_idle <= 0 or now - wants.get(a.adapter, Demand()).last_used >= min_idle
            taken[a.replica].discard(a.adapter)
    for rid, held in taken.items():
        # Never more than the engine holds at once (unless it already did).
        assert len(held) <= max(by_id[rid].capacity, len(by_id[rid].taken))
    # Every adapter with requests held and no holder gets one, while any replica has a
    # free slot or one it may free.
    free = any(
        len(r.taken) < r.capacity
        or any(
            a not in r.loading
            and wants.get(a, Demand()).held == 0
            and (min_idle <= 0 or now - wants.get(a, Demand()).last_used >= min_idle)
            for a in r.taken
        )
        for r in reps
        if r.capacity > 0
    )
    waiting = [a for a, d in wants.items() if d.held and not any(a in r.taken for r in reps)]
    if waiting and free:
        assert any(a.kind == "load" and a.adapter in waiting for a in actions)
    # Each adapter is loaded at most once per replica.
    loads = [(a.replica, a.adapter) for a in actions if a.kind == "load"]
    assert len(loads) == len(set(loads))


# --- the manager: an adapter leaves routers' view before the engine lets it go ------------


def test_an_unload_is_hidden_from_routers_first_and_sent_after_the_grace(tmp_path: Path) -> None:
    from llmgw_control.lora import UNLOAD_GRACE, LoraManager
    from llmgw_control.publish import EndpointInfo
    from llmgw_proto import v1
    from prometheus_client import CollectorRegistry

    model = base(max_loras=1)
    catalog = load_control_config(write(tmp_path, [model])).catalog
    ep = EndpointInfo(
        "r1",
        "http://127.0.0.1:1",
        ("gemma",),
        "gemma",
        "default",
        1,
        "n1",
        (),
        "r1",
        "/health",
        shard_id="r1-0",
    )
    held = {"r1": frozenset({"sql"})}
    sent: list[v1.ControlMessage] = []
    touched: list[str] = []
    manager = LoraManager(CollectorRegistry())
    manager.touch = touched.append

    def record(node: str, command_id: str, msg: v1.ControlMessage) -> bool:
        sent.append(msg)
        return True

    def step(now: float) -> None:
        manager.step(
            catalog,
            [ep],
            lambda e: (held[e], 0.0),
            record,
            now,
        )

    manager.on_demand("sql", 0, 1, 1.0)
    manager.on_demand("chat", 2, 2, 20.0)
    step(20.0)
    # chat is loaded at once; sql, idle, is hidden from routers but still loaded.
    assert [m.load_adapter.name for m in sent if m.load_adapter] == ["chat"]
    assert not [m for m in sent if m.unload_adapter]
    assert manager.hidden("r1") == {"sql"}
    assert touched == ["r1"]
    step(20.0 + UNLOAD_GRACE)
    assert [m.unload_adapter.name for m in sent if m.unload_adapter] == ["sql"]
    # Until a load report shows it gone, routers are still not told of it.
    assert manager.hidden("r1") == {"sql"}
    held["r1"] = frozenset({"chat"})
    for m in sent:
        command = m.load_adapter or m.unload_adapter
        assert command is not None
        manager.on_result(command.command_id, True, "")
    step(30.0)
    assert manager.hidden("r1") == frozenset()
    assert manager.status(catalog, [ep], lambda e: (held[e], 0.0), 30.0)["unloads"] == 1


def test_status_table_lists_adapters_and_counts() -> None:
    from llmgw_control.lora import render_adapters

    data = {
        "lora": {
            "adapters": {
                "sql": {
                    "model": "gemma",
                    "holders": ["r1"],
                    "loading": [],
                    "held_requests": 0,
                    "rate": 0.5,
                    "last_error": "",
                }
            },
            "loads": 2,
            "load_failures": 1,
            "unloads": 1,
            "unload_failures": 0,
        }
    }
    (text,) = render_adapters(data, lambda rows, header: repr((header, rows)))
    assert "'sql', 'gemma', 'r1', '-', '0', '0.5/s', '-'" in text
    assert text.endswith("adapter loads 2 (1 failed), unloads 1 (0 failed)")
    assert render_adapters({}, lambda rows, header: "") == []
