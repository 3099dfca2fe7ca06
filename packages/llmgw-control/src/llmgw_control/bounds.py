"""What one node may report: pure checks, apart from the stream that applies them.

Every gRPC message is already bounded in bytes (``max_message_bytes``); within that, a
node's Register is kept small (it is stored and served on every status poll), its
labels are counted and measured, a shard status's free text is cut to size, and the
shards a node reports that the control plane never asked it to run are counted: past
:attr:`Bounds.shards` such a report is dropped (a real node runs a handful).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw_proto import v1

__all__ = [
    "Bounds",
    "admit_shard",
    "clip",
    "clip_status",
    "engines_problem",
    "register_problem",
    "status_problem",
]


@dataclass(frozen=True)
class Bounds:
    # The whole Register, encoded.
    register_bytes: int = 1024 * 1024
    # Node labels: how many, and each key's and value's length (Kubernetes allows a
    # 253-character prefix and a 63-character name; values here may be longer).
    labels: int = 64
    label_key: int = 317
    label_value: int = 1024
    # Shard reports one node may hold (Register's shards; statuses of shards the control
    # plane did not ask for are dropped past this many).
    shards: int = 256
    # ShardStatus.reason and output_tail are kept cut to these many characters.
    reason: int = 4096
    output_tail: int = 64 * 1024
    # A shard status with an id, replica id or endpoint URL longer than this, or more GPU
    # indices than this, is not a real one: it is dropped.
    status_id: int = 1024
    gpu_indices: int = 256
    # Engines one node reports, and the flags each engine's help lists (EngineInfo's
    # value_flags + switch_flags) and each flag's length: the agent sends none past these
    # (llmgw_agent.engines.FLAGS_MAX, FLAG_CHARS_MAX); real engines list 400-600.
    engines: int = 16
    engine_flags: int = 4096
    engine_flag: int = 128


def register_problem(msg: v1.Register, bounds: Bounds, size: int | None = None) -> str | None:
    """Pure: why ``msg`` is too much for one node (naming the field), None if it is fine.

    ``size`` is the message's encoded size if known (else it is encoded here).
    """
    labels = dict(msg.labels)
    if len(labels) > bounds.labels:
        return f"labels: {len(labels)} labels, at most {bounds.labels}"
    for key, value in labels.items():
        if len(key) > bounds.label_key:
            return (
                f"labels: key {key[:40]!r}... is {len(key)} characters, at most {bounds.label_key}"
            )
        if len(value) > bounds.label_value:
            return (
                f"labels[{key[:80]!r}]: value of {len(value)} characters, "
                f"at most {bounds.label_value}"
            )
    if len(msg.shards) > bounds.shards:
        return f"shards: {len(msg.shards)} shards reported, at most {bounds.shards}"
    problem = engines_problem(msg.engines, bounds)
    if problem:
        return problem
    encoded = size if size is not None else len(bytes(msg))
    if encoded > bounds.register_bytes:
        return f"the Register is {encoded} bytes, at most {bounds.register_bytes}"
    return None


def engines_problem(engines: list[v1.EngineInfo], bounds: Bounds) -> str | None:
    """Pure: why Register's ``engines`` are more than one node's (naming the field)."""
    if len(engines) > bounds.engines:
        return f"engines: {len(engines)} engines reported, at most {bounds.engines}"
    for i, e in enumerate(engines):
        count = len(e.value_flags) + len(e.switch_flags)
        if count > bounds.engine_flags:
            return f"engines[{i}]: {count} flags, at most {bounds.engine_flags}"
        for field in ("value_flags", "switch_flags"):
            for flag in getattr(e, field):
                if len(flag) > bounds.engine_flag:
                    return (
                        f"engines[{i}].{field}: {flag[:40]!r}... is {len(flag)} characters, "
                        f"at most {bounds.engine_flag}"
                    )
    return None


def status_problem(msg: v1.ShardStatus, bounds: Bounds) -> str | None:
    """Pure: why a shard status is not one a node could mean (naming the field), or None."""
    for field in ("shard_id", "replica_id", "endpoint_url"):
        value = getattr(msg, field)
        if len(value) > bounds.status_id:
            return f"{field}: {len(value)} characters, at most {bounds.status_id}"
    if len(msg.gpu_indices) > bounds.gpu_indices:
        return f"gpu_indices: {len(msg.gpu_indices)} indices, at most {bounds.gpu_indices}"
    return None


def admit_shard(*, held: int, known: bool, asked: bool, bounds: Bounds) -> bool:
    """Pure: keep a status report for a shard? Always for one held or asked for; a shard
    the node runs on its own is kept while the node holds fewer than ``bounds.shards``."""
    return known or asked or held < bounds.shards


def clip(text: str, limit: int, *, keep_end: bool = False) -> str:
    """Pure: ``text`` cut to ``limit`` characters, saying so (the end kept for a tail)."""
    if len(text) <= limit:
        return text
    mark = f"[... cut from {len(text)} characters]"
    if len(mark) >= limit:
        return text[-limit:] if keep_end else text[:limit]
    room = limit - len(mark)
    return mark + text[-room:] if keep_end else text[:room] + mark


def clip_status(msg: v1.ShardStatus, bounds: Bounds) -> v1.ShardStatus:
    """The status with its free text cut to size (the message itself is changed)."""
    msg.reason = clip(msg.reason, bounds.reason)
    msg.output_tail = clip(msg.output_tail, bounds.output_tail, keep_end=True)
    return msg
