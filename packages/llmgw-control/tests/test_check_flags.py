"""`check --admin`'s engine flags (issue 29 point 9): engine_args judged against the flags
the agents report their engines' help lists (check.unknown_flags, against_engine_flags),
and the bounds on what a Register may carry of them (bounds.engines_problem). Pure."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from llmgw_control.bounds import Bounds, register_problem
from llmgw_control.catalog import ProfileSpec
from llmgw_control.check import against_engine_flags, unknown_flags
from llmgw_control.engine_report import flags_view
from llmgw_control.inventory import Inventory
from llmgw_proto import v1

VALUE = frozenset({"--max-model-len", "-tp", "--tensor-parallel-size", "--kv-transfer-config"})
SWITCH = frozenset({"--enforce-eager", "--trust-remote-code", "--no-trust-remote-code"})


def profile(args: list[str], engine: str = "vllm", name: str = "big") -> ProfileSpec:
    return ProfileSpec(
        model="chat",
        name=name,
        engine=engine,  # type: ignore[arg-type]
        model_ref="org/model",
        engine_args=tuple(args),
        env=(),
        gpus_per_node=1,
        cpu_threads=0,
        nodes=1,
        gpu_name="",
        min_memory_bytes=0,
        same_label="",
        replicas=1,
        served_model_names=("chat",),
        weight=1,
        load_timeout=60.0,
    )


def test_unknown_flags_examples() -> None:
    ok = ["--max-model-len", "4096", "-tp", "2", "--enforce-eager", "--max-model-len=8"]
    assert unknown_flags("vllm", ok, VALUE, SWITCH) == []
    # vLLM's spellings: --x_y, --json-arg.key, -tp2, -O3.
    assert unknown_flags("vllm", ["--max_model_len", "8", "-tp2"], VALUE, SWITCH) == []
    assert unknown_flags("vllm", ["--kv-transfer-config.kv_role", "kv_both"], VALUE, SWITCH) == []
    assert unknown_flags("vllm", ["--enforce-eager.x", "1"], VALUE, SWITCH) == ["--enforce-eager.x"]
    assert unknown_flags("vllm", ["-O3"], VALUE, SWITCH) == ["-O3"]
    assert unknown_flags("vllm", ["-O3"], VALUE | {"--optimization-level"}, SWITCH) == []
    # Negative numbers are values; each unknown flag is named once, in order.
    assert unknown_flags(
        "sglang",
        ["--seed", "-1", "--nope", "--max-model-len", "1", "--nope=2", "--also"],
        VALUE | {"--seed"},
        SWITCH,
    ) == ["--nope", "--also"]
    # llama.cpp takes values that start with one '-'; an unknown long flag is still named.
    assert unknown_flags("llamacpp", ["-c", "-5", "--bogus"], frozenset({"-c"}), frozenset()) == [
        "--bogus"
    ]


_WORD = st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=8)
_FLAG = st.builds(lambda w: "--" + w, _WORD)


@st.composite
def _known_and_args(draw: Any) -> tuple[frozenset[str], frozenset[str], list[str]]:
    value = frozenset(draw(st.lists(_FLAG, min_size=1, max_size=6)))
    switch = frozenset(draw(st.lists(_FLAG, max_size=6))) - value
    args: list[str] = []
    for _ in range(draw(st.integers(0, 10))):
        if switch and draw(st.booleans()):
            args.append(draw(st.sampled_from(sorted(switch))))
            continue
        flag = draw(st.sampled_from(sorted(value)))
        word = draw(st.one_of(_WORD, st.integers(-99, 99).map(str)))
        args.extend([f"{flag}={word}"] if draw(st.booleans()) else [flag, word])
    return value, switch, args


@given(_known_and_args(), st.sampled_from(["vllm", "sglang", "llamacpp"]))
def test_args_of_listed_flags_pass(case: Any, engine: str) -> None:
    value, switch, args = case
    assert unknown_flags(engine, args, value, switch) == []


@given(_known_and_args(), _WORD, st.data(), st.sampled_from(["vllm", "sglang", "llamacpp"]))
def test_a_flag_not_listed_is_named(case: Any, word: str, data: Any, engine: str) -> None:
    value, switch, args = case
    bad = "--zz-" + word  # the generated flags never start with "--zz-"
    where = data.draw(st.integers(0, len(args)))
    # Put it between whole flag/value groups: at the start or before a flag.
    while 0 < where < len(args) and not args[where].startswith("--"):
        where -= 1
    args = [*args[:where], bad, *args[where:]]
    assert unknown_flags(engine, args, value, switch) == [bad]


def _report(*nodes: tuple[str, str, str, bool]) -> dict[str, Any]:
    return {
        "nodes": [
            {
                "node_id": node,
                "state": state,
                "engines": [
                    {
                        "kind": "vllm",
                        "version": version,
                        "error": "",
                        "flags_listed": listed,
                        "value_flags": sorted(VALUE),
                        "switch_flags": sorted(
                            SWITCH - ({"--enforce-eager"} if version == "0.1" else set())
                        ),
                    }
                ],
            }
            for node, state, version, listed in nodes
        ]
    }


def test_against_engine_flags_names_field_flag_version_and_nodes() -> None:
    report = _report(
        ("gpu-a", "READY", "0.32.0", True),
        ("gpu-b", "READY", "0.32.0", True),
        ("gpu-c", "READY", "0.1", True),
        ("gpu-d", "UNREACHABLE", "0.0", True),
        ("gpu-e", "READY", "0.2", False),
    )
    found = against_engine_flags(
        [
            profile(["--enforce-eager", "--bogus", "1"]),
            profile(["--bogus"], engine="sglang", name="s"),
        ],
        report,
    )
    assert found == [
        "models[chat].profiles.big.engine_args: '--enforce-eager' is not a flag vllm 0.1 "
        "accepts (node gpu-c)",
        "models[chat].profiles.big.engine_args: '--bogus' is not a flag vllm 0.1 accepts "
        "(node gpu-c)",
        "models[chat].profiles.big.engine_args: '--bogus' is not a flag vllm 0.32.0 accepts "
        "(nodes gpu-a, gpu-b)",
    ]
    assert (
        against_engine_flags([profile(["--enforce-eager"])], _report(("a", "READY", "1", True)))
        == []
    )


def _register(flags: list[str], engines: int = 1) -> v1.Register:
    info = v1.EngineInfo(kind=v1.EngineKind.VLLM, version="1", value_flags=flags, flags_listed=True)
    return v1.Register(node_id="n", engines=[info] * engines)


def test_register_bounds_on_engine_flags() -> None:
    bounds = Bounds(engines=2, engine_flags=3, engine_flag=10)
    assert register_problem(_register(["--a", "--b", "--c"]), bounds) is None
    assert register_problem(_register(["--a"] * 4), bounds) == "engines[0]: 4 flags, at most 3"
    long = register_problem(_register(["--" + "x" * 20]), bounds)
    assert long is not None
    assert long.startswith("engines[0].value_flags: ")
    assert register_problem(_register([], 3), bounds) == "engines: 3 engines reported, at most 2"


def test_register_stores_the_flags_and_the_view_serves_them() -> None:
    inv = Inventory()
    msg = _register(["--max-model-len"])
    msg.engines[0].switch_flags = ["--enforce-eager"]
    inv.register(msg, "s", "127.0.0.1", 0.0)
    view = flags_view(inv.nodes)
    (engine,) = view["nodes"][0]["engines"]
    assert engine["flags_listed"] is True
    assert engine["value_flags"] == ["--max-model-len"]
    assert engine["switch_flags"] == ["--enforce-eager"]
