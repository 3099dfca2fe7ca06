"""vLLM's KV-cache events, published over ZMQ as vLLM 0.32 publishes them.

With ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "topic": "..."}'`` (and the step scheduler, whose block cache
is what the events describe), every engine step that stored or evicted prefix blocks
sends one multipart message on a ZMQ PUB socket: ``(topic, sequence number as 8 bytes
big-endian, msgpack [timestamp, [event, ...], data_parallel_rank])``. Events are maps
tagged by ``type`` as vLLM encodes them: ``BlockStored`` (``block_hashes``,
``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``, ``medium``,
``lora_name``) and ``BlockRemoved`` (``block_hashes``, ``medium``). Block hashes are the
scheduler's signed 64-bit integers, as vLLM sends them with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``; ``token_ids`` is each block's token ids when
``--tokenizer`` gives the simulator a real tokenizer, else empty (its own crude tokens
have no ids of a real vocabulary).

Like vLLM 0.32's ``ZmqEventPublisher``, the PUB socket *binds* only a
wildcard endpoint (``*`` or ``::`` in it: ``tcp://*:5557``) or a local one (``ipc://``,
``inproc://``) and *connects* to any other address (``tcp://127.0.0.1:5557``), where the
subscriber binds (:func:`binds`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from llmgw_sim.config import StartupError


@dataclass(frozen=True)
class KvEventsConfig:
    endpoint: str
    topic: str


def parse_config(raw: str | None) -> KvEventsConfig | None:
    """The ZMQ publisher --kv-events-config asks for, None when it asks for none."""
    if not raw:
        return None
    try:
        config = json.loads(raw)
    except ValueError:
        raise StartupError(
            "ValueError", f"--kv-events-config must be JSON, got {raw!r}", phase="config"
        ) from None
    if not isinstance(config, dict) or not config.get("enable_kv_cache_events"):
        return None
    publisher = config.get("publisher", "zmq")
    if publisher not in ("zmq", "null"):
        raise StartupError("ValueError", f"Unknown event publisher '{publisher}'")
    if publisher == "null":
        return None
    return KvEventsConfig(
        endpoint=str(config.get("endpoint") or "tcp://*:5557"),
        topic=str(config.get("topic") or ""),
    )


def events(
    stored: Sequence[tuple[int, int | None, Sequence[int]]], removed: list[int], block_size: int
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for h, parent, token_ids in stored:
        out.append(
            {
                "type": "BlockStored",
                "block_hashes": [h],
                "parent_block_hash": parent,
                "token_ids": list(token_ids),
                "block_size": block_size,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            }
        )
    if removed:
        out.append({"type": "BlockRemoved", "block_hashes": list(removed), "medium": "GPU"})
    return out


def binds(endpoint: str) -> bool:
    """Whether the publisher binds ``endpoint`` (else it connects to it): vLLM's rule, a
    wildcard (``*`` or ``::`` anywhere in it) or an ``ipc://``/``inproc://`` endpoint."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class Publisher:
    """A ZMQ PUB socket sending batches with consecutive sequence numbers, bound or
    connected as :func:`binds` says."""

    def __init__(self, config: KvEventsConfig) -> None:
        import zmq

        self._zmq = zmq
        self._context = zmq.Context()
        self._sock = self._context.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            if binds(config.endpoint):
                self._sock.bind(config.endpoint)
            else:
                # Connecting succeeds whether or not anything listens there yet (ZMQ
                # retries in the background); only a malformed address fails here.
                self._sock.connect(config.endpoint)
        except zmq.ZMQError as err:
            self.close()
            raise StartupError(
                "zmq.error.ZMQError", f"{err.strerror} (addr='{config.endpoint}')", phase="load"
            ) from None
        self._topic = config.topic.encode()
        self._seq = 0
        self.sent = 0

    def publish(self, batch: list[dict[str, Any]]) -> None:
        if not batch:
            return
        payload = msgspec.msgpack.encode([time.time(), batch, None])
        try:
            self._sock.send_multipart(
                [self._topic, self._seq.to_bytes(8, "big"), payload], flags=self._zmq.NOBLOCK
            )
        except self._zmq.Again:
            pass  # a PUB socket drops what no subscriber can take; the number still counts
        self._seq += 1
        self.sent += 1

    def close(self) -> None:
        self._sock.close(0)
        self._context.term()
