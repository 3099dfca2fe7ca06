"""The control plane's spans of a replica's start (llmgw_proto.tracing), when tracing is on.

``control.place`` for each StartShard a reconcile pass decided (replica, shard, node,
model, profile, GPUs, port, rank), with ``control.send_start`` as its child around the
send; the StartShard carries the send span's traceparent, so the agent's
``agent.start_shard`` (validation, launch) and ``agent.load`` (until READY) are in the
same trace. Each ShardStatus the agent sends carries its own span's traceparent, and
``control.shard_status`` (the state, the reason) is recorded as its child: a replica's
start, from the placement to READY, is one trace.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from llmgw_proto import tracing, v1

from llmgw_control.records import Start

__all__ = ["sending_start", "shard_status"]


@contextlib.contextmanager
def sending_start(command: Start, command_id: str) -> Iterator[None]:
    """Around the send of one StartShard: its message gets the send span's traceparent
    (see :func:`stamp_start`)."""
    with (
        tracing.span(
            "control.place",
            replica=command.replica_id,
            shard=command.shard_id,
            node=command.node_id,
            model=command.profile.model,
            profile=command.profile.name,
            gpus=",".join(str(g) for g in command.gpu_indices),
            port=command.port,
            rank=command.rank,
        ),
        tracing.span("control.send_start", command_id=command_id),
    ):
        yield


def stamp_start(msg: v1.ControlMessage) -> v1.ControlMessage:
    """A StartShard message with the current span's traceparent (off: unchanged)."""
    tp = tracing.traceparent()
    if tp and msg.start_shard is not None:
        msg.start_shard.traceparent = tp
    return msg


def shard_status(node_id: str, msg: v1.ShardStatus) -> None:
    """``control.shard_status``: a child of the agent's span that sent ``msg``."""
    if not msg.traceparent:
        return
    with tracing.span(
        "control.shard_status",
        parent=msg.traceparent,
        node=node_id,
        shard=msg.shard_id,
        replica=msg.replica_id,
        state=v1.ShardState(msg.state).name,
        reason=msg.reason or None,
        routes=len(msg.routes),
    ):
        pass
