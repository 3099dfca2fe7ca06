"""Our generated classes against protoc's standard Python output.

Every message defined in llmgw/v1 is filled with arbitrary values through
protoc's classes, sent through ours and back, and must come out unchanged;
the JSON each side renders must agree field by field. So the bytes llmgw puts
on the wire are protobuf that any gRPC implementation reads the same way.
"""

from __future__ import annotations

from datetime import timedelta
from types import ModuleType
from typing import Any

import betterproto2
import pytest
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llmgw_proto import v1

FD = FieldDescriptor
# protoc's Python runtime is dynamic (its descriptors and messages come from C), so
# they are typed loosely here.
Descriptor = Any
Message = Any

SCALARS: dict[int, st.SearchStrategy[Any]] = {
    FD.TYPE_STRING: st.text(max_size=12),
    FD.TYPE_BYTES: st.binary(max_size=12),
    FD.TYPE_BOOL: st.booleans(),
    FD.TYPE_UINT32: st.integers(0, 2**32 - 1),
    FD.TYPE_UINT64: st.integers(0, 2**64 - 1),
    FD.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
    FD.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
    # betterproto2 treats -0.0 as the default and drops it (protoc keeps its sign bit);
    # llmgw never sends a negative zero, so the round trip draws non-negative values.
    FD.TYPE_DOUBLE: st.floats(allow_nan=False, allow_infinity=False).map(abs),
    FD.TYPE_FLOAT: st.floats(width=32, allow_nan=False, allow_infinity=False).map(abs),
}


def _all_messages(modules: dict[str, ModuleType]) -> list[Descriptor]:
    found: list[Descriptor] = []
    for module in modules.values():
        found.extend(module.DESCRIPTOR.message_types_by_name.values())
    return sorted(found, key=lambda d: d.full_name)


def _fill(draw: st.DrawFn, msg: Message, depth: int = 0) -> None:
    for field in msg.DESCRIPTOR.fields:
        if field.containing_oneof is not None and not draw(st.booleans()):
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_t = field.message_type.fields_by_name["key"]
            val_t = field.message_type.fields_by_name["value"]
            items = draw(st.dictionaries(SCALARS[key_t.type], SCALARS[val_t.type], max_size=3))
            getattr(msg, field.name).update(items)
        elif field.message_type is not None:
            count = draw(st.integers(0, 2)) if _repeated(field) else 1
            if depth > 3:
                continue
            for _ in range(count):
                child = getattr(msg, field.name).add() if _repeated(field) else None
                if child is None:
                    child = getattr(msg, field.name)
                    child.SetInParent()
                _fill_known(draw, child, depth + 1)
        elif field.enum_type is not None:
            numbers = [v.number for v in field.enum_type.values]
            _set(msg, field, draw, st.sampled_from(numbers))
        else:
            _set(msg, field, draw, SCALARS[field.type])


def _repeated(field: Any) -> bool:
    return (
        bool(field.is_repeated)
        if hasattr(field, "is_repeated")
        else field.label == FD.LABEL_REPEATED
    )


def _fill_known(draw: st.DrawFn, msg: Message, depth: int) -> None:
    name = msg.DESCRIPTOR.full_name
    if name == "google.protobuf.Timestamp":
        msg.seconds = draw(st.integers(0, 4_000_000_000))
        msg.nanos = draw(st.integers(0, 999_999)) * 1000  # Python datetimes hold microseconds
    elif name == "google.protobuf.Duration":
        msg.seconds = draw(st.integers(0, 10**6))
        msg.nanos = draw(st.integers(0, 999_999)) * 1000
    else:
        _fill(draw, msg, depth)


def _set(msg: Message, field: Any, draw: st.DrawFn, values: st.SearchStrategy[Any]) -> None:
    if _repeated(field):
        getattr(msg, field.name).extend(draw(st.lists(values, max_size=3)))
    else:
        setattr(msg, field.name, draw(values))


@st.composite
def filled(draw: st.DrawFn, cls: type[Message]) -> Message:
    msg: Message = cls()
    _fill(draw, msg)
    return msg


def _ours(descriptor: Descriptor) -> type[betterproto2.Message]:
    cls: type[betterproto2.Message] = getattr(v1, descriptor.name)
    assert issubclass(cls, betterproto2.Message)
    return cls


def _no_unknown_fields(msg: betterproto2.Message) -> None:
    assert msg._unknown_fields == b"", f"{type(msg).__name__} kept bytes it did not understand"
    for value in vars(msg).values():
        items = (
            value
            if isinstance(value, list)
            else list(value.values())
            if isinstance(value, dict)
            else [value]
        )
        for item in items:
            if isinstance(item, betterproto2.Message):
                _no_unknown_fields(item)


def test_every_message_and_enum_is_generated(protoc_modules: dict[str, ModuleType]) -> None:
    for descriptor in _all_messages(protoc_modules):
        _ours(descriptor)
    for module in protoc_modules.values():
        for enum in module.DESCRIPTOR.enum_types_by_name.values():
            ours = getattr(v1, enum.name)
            assert sorted(m.value for m in ours) == sorted(v.number for v in enum.values)


def test_shard_states_are_the_designed_ones() -> None:
    names = [s.name for s in v1.ShardState if s.value != 0]
    assert names == ["PENDING", "VALIDATING", "STARTING", "READY", "DRAINING", "STOPPED", "FAILED"]


MESSAGE_NAMES = [
    "AgentMessage", "ControlMessage", "Register", "Inventory", "Gpu", "Host", "NetworkInterface",
    "RunningShard", "Heartbeat", "GpuUsage", "ShardStatus", "CommandResult", "RegisterAck",
    "StartShard", "MultiNode", "StopShard", "DrainShard", "WatchRequest", "EndpointSnapshot",
    "Endpoint", "EngineInfo", "LoadReport", "EngineLoad", "CacheEvents", "DeclaredModel",
    "LoadUpdate", "EndpointLoad", "EndpointCache", "DemandRequest", "DemandReply",
    "LogsRequest", "LogsCredit", "LogsCancel", "LogsChunk",
    # Tenant keys (issue 24), LoRA adapters, routers' request reports (issue 29).
    "ApiKey", "KeySet", "KeyUsage", "UsageReport", "KeyShare", "UsageReply",
    "LoadAdapter", "UnloadAdapter", "ModelRequests", "RequestReport", "RequestReply",
    # Routers' shared prefixes (issue 26).
    "PrefixKey", "ModelPrefixes", "PrefixReport", "PrefixSet",
]  # fmt: skip


def test_the_test_covers_every_message(protoc_modules: dict[str, ModuleType]) -> None:
    assert sorted(MESSAGE_NAMES) == sorted(d.name for d in _all_messages(protoc_modules))


@pytest.mark.parametrize("name", MESSAGE_NAMES)
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_round_trip_through_protoc_classes(
    protoc_modules: dict[str, ModuleType], name: str, data: st.DataObject
) -> None:
    module = next(m for m in protoc_modules.values() if name in m.DESCRIPTOR.message_types_by_name)
    theirs_cls = getattr(module, name)
    original = data.draw(filled(theirs_cls))
    wire = original.SerializeToString()

    ours = _ours(original.DESCRIPTOR).parse(wire)
    _no_unknown_fields(ours)
    back = theirs_cls.FromString(bytes(ours))
    assert back == original

    # Field by field: the proto3 JSON we render reads back, in protoc's classes, as the
    # same message (so each field landed in the field of the same name and meaning).
    from_json = json_format.ParseDict(ours.to_dict(), theirs_cls())
    assert from_json == original


def _examples() -> dict[str, betterproto2.Message]:
    """One message of each kind added since the first rounds, filled as llmgw fills it."""
    key = v1.ApiKey(
        name="team-a",
        prefix="llmgw_3f9a1c2b",
        sha256="9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
        models=["llama-3-8b", "llama-3-8b:sql-lora"],
        rpm=600,
        tpm=1_000_000,
        max_concurrent=16,
        priority="interactive",
        weight=3,
        budget_tokens=50_000_000,
        budget_period="month",
        revoked=False,
    )
    usage = v1.KeyUsage(
        key="team-a",
        requests=120,
        prompt_tokens=48_000,
        completion_tokens=9_600,
        errors=2,
        refused=5,
        held_seconds=3.25,
        demand_rpm=640.5,
        demand_tpm=1_050_000.0,
        in_flight=7,
    )
    share = v1.KeyShare(
        key="team-a",
        rpm=300.0,
        tpm=500_000.0,
        max_concurrent=8,
        budget_tokens=250_000,
        budget_used=12_345_678,
    )
    model = v1.ModelRequests(
        model="llama-3-8b",
        requests=431,
        errors=3,
        ttft_bounds=[0.05, 0.1, 0.25, 0.5, 1.0, float("inf")],
        ttft_counts=[120, 200, 80, 20, 8, 3],
    )
    prefix = v1.PrefixKey(key=0x9E3779B97F4A7C15, size=132, count=37, holder="gpu-a-llama-r0")
    prefixes = v1.ModelPrefixes(model="", keys=[prefix, v1.PrefixKey(key=1 << 63, size=0, count=1)])
    return {
        "PrefixKey": prefix,
        "ModelPrefixes": prefixes,
        "PrefixReport": v1.PrefixReport(router_id="router-1/w0", models=[prefixes]),
        "PrefixSet": v1.PrefixSet(models=[prefixes], routers=4),
        "ApiKey": key,
        "KeySet": v1.KeySet(version=17, keys=[key, v1.ApiKey(name="old", revoked=True)]),
        "KeyUsage": usage,
        "UsageReport": v1.UsageReport(
            router_id="router-1", usage=[usage], sequence=42, instance="5c1e0b7a"
        ),
        "KeyShare": share,
        "UsageReply": v1.UsageReply(shares=[share], valid_for=timedelta(seconds=15)),
        "LoadAdapter": v1.LoadAdapter(
            command_id="cmd-9",
            shard_id="llama-3-8b-r0-s0",
            name="sql-lora",
            source="/models/adapters/sql-lora",
            epoch=4,
        ),
        "UnloadAdapter": v1.UnloadAdapter(
            command_id="cmd-10", shard_id="llama-3-8b-r0-s0", name="sql-lora", epoch=4
        ),
        "ModelRequests": model,
        "RequestReport": v1.RequestReport(
            router_id="router-1", models=[model, v1.ModelRequests(model="(unknown)")], interval=5.0
        ),
        "RequestReply": v1.RequestReply(),
    }


@pytest.mark.parametrize("name", sorted(_examples()))
def test_realistic_example_round_trips(protoc_modules: dict[str, ModuleType], name: str) -> None:
    ours = _examples()[name]
    module = next(m for m in protoc_modules.values() if name in m.DESCRIPTOR.message_types_by_name)
    theirs = getattr(module, name).FromString(bytes(ours))
    back = type(ours).parse(theirs.SerializeToString())
    _no_unknown_fields(back)
    assert back == ours
    # Each field arrived under the same name with the same value on protoc's side.
    assert json_format.MessageToDict(theirs) == ours.to_dict()


def test_register_carries_fabric_labels_and_running_shards(
    protoc_modules: dict[str, ModuleType],
) -> None:
    register = v1.Register(
        node_id="gpu-a",
        agent_version="0.1.0",
        labels={"fabric.nvlink-domain": "nvl-1", "fabric.ib-subnet": "ib-7"},
        inventory=v1.Inventory(
            gpus=[v1.Gpu(index=0, uuid="GPU-1", name="NVIDIA H200", nvlink_peers=["0000:19:00.0"])],
            simulated=True,
        ),
        shards=[v1.RunningShard(shard_id="s-0", replica_id="r", port=20001, pid=42)],
    )
    theirs = protoc_modules["agent"].AgentMessage.FromString(
        bytes(v1.AgentMessage(register=register))
    )
    assert theirs.WhichOneof("kind") == "register"
    assert dict(theirs.register.labels) == {
        "fabric.nvlink-domain": "nvl-1",
        "fabric.ib-subnet": "ib-7",
    }
    assert theirs.register.inventory.gpus[0].nvlink_peers == ["0000:19:00.0"]
    assert theirs.register.inventory.simulated is True
    assert theirs.register.shards[0].pid == 42
