"""KV-cache events: which prefix blocks an engine stored and evicted, relayed upstream.

vLLM (and SGLang, in the same format) publish them when a profile asks for it with
``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557"}'``: a ZMQ PUB socket sending ``(topic, seq: 8 bytes big-endian,
payload)`` where the payload is a msgpack ``[ts, [event, ...], dp_rank]`` and each event is
a tagged struct: ``BlockStored`` (block_hashes, parent_block_hash, token_ids, block_size,
...), ``BlockRemoved`` (block_hashes, ...) or ``AllBlocksCleared``.

The agent subscribes on loopback and relays them compactly as CacheEvents: block hashes
as 64-bit integers (a sha256 hash keeps its low 64 bits, as vLLM's own
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` does), stored and removed batched per interval.
A gap in the sequence numbers, a new stream or a restarted engine sends ``cleared`` so the
receiver forgets that engine's blocks rather than trusting a view with holes in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
from llmgw_proto import v1

from llmgw_agent.engine_flags import ParsedArgs

__all__ = ["CacheDelta", "KvEventsRelay", "KvSource", "decode_batch", "kv_events_target"]

log = structlog.get_logger(__name__)

_MASK = (1 << 64) - 1


def kv_events_target(parsed: ParsedArgs) -> tuple[str, str] | None:
    """(endpoint to connect to on loopback, topic) when engine_args publish KV events."""
    raw = parsed.first("--kv-events-config")
    if raw is None:
        return None
    try:
        config = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(config, dict) or not config.get("enable_kv_cache_events"):
        return None
    if config.get("publisher", "zmq") != "zmq":
        return None
    endpoint = str(config.get("endpoint") or "tcp://*:5557")
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        if endpoint.startswith(wildcard):
            endpoint = "tcp://127.0.0.1:" + endpoint[len(wildcard) :]
    return endpoint, str(config.get("topic") or "")


def _hash(value: object) -> int | None:
    if isinstance(value, bytes):
        return int.from_bytes(value, "big") & _MASK
    if isinstance(value, int) and not isinstance(value, bool):
        return value & _MASK
    return None


def _fields(event: Any) -> tuple[str, dict[str, Any]]:
    """(type, fields) of one event, map-encoded (``{"type": ...}``) or array-encoded."""
    if isinstance(event, dict):
        return str(event.get("type", "")), event
    if isinstance(event, list) and event and isinstance(event[0], str):
        kind, rest = event[0], event[1:]
        names = {
            "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
            "BlockRemoved": ("block_hashes",),
        }.get(kind, ())
        return kind, dict(zip(names, rest, strict=False))
    return "", {}


@dataclass
class CacheDelta:
    """What one engine's cache did since the last relay."""

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    cleared: bool = False
    block_size: int = 0

    def add(self, other: CacheDelta) -> None:
        if other.cleared:
            # Everything before a clear is moot.
            self.stored, self.removed, self.cleared = [], [], True
        self.stored += other.stored
        self.removed += other.removed
        self.block_size = other.block_size or self.block_size

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.cleared)


def decode_batch(payload: bytes) -> CacheDelta:
    """One published batch as a delta; ValueError when it is not a KV event batch."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as err:
        raise ValueError(f"not msgpack: {err}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not a KV event batch: expected [ts, events, ...]")
    delta = CacheDelta()
    for event in batch[1]:
        kind, fields = _fields(event)
        hashes = [h for h in map(_hash, fields.get("block_hashes") or []) if h is not None]
        if kind == "BlockStored":
            delta.stored += hashes
            size = fields.get("block_size")
            if isinstance(size, int):
                delta.block_size = size
        elif kind == "BlockRemoved":
            delta.removed += hashes
        elif kind == "AllBlocksCleared":
            delta.add(CacheDelta(cleared=True))
    return delta


@dataclass(frozen=True)
class KvSource:
    shard_id: str
    endpoint: str
    topic: str
    generation: int


class KvEventsRelay:
    """Subscribes to every engine that publishes KV events; sends CacheEvents each interval."""

    def __init__(
        self,
        sources: Callable[[], Iterable[KvSource]],
        send: Callable[[v1.CacheEvents], None],
        *,
        interval: Callable[[], float],
        session: Callable[[], int],
    ) -> None:
        self.sources = sources
        self.send = send
        self.interval = interval
        self.session = session
        self._subscribers: dict[KvSource, asyncio.Task[None]] = {}
        self._pending: dict[KvSource, CacheDelta] = {}
        self._session = 0
        self.relayed = 0

    def _receive(self, source: KvSource, delta: CacheDelta) -> None:
        self._pending.setdefault(source, CacheDelta()).add(delta)

    async def _subscribe(self, source: KvSource) -> None:
        import zmq
        import zmq.asyncio

        context = zmq.asyncio.Context.instance()
        sock = context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        sock.connect(source.endpoint)
        last_seq: int | None = None
        try:
            while True:
                parts = await sock.recv_multipart()
                if len(parts) != 3:
                    continue
                seq = int.from_bytes(parts[1], "big")
                if last_seq is not None and seq != last_seq + 1:
                    log.warning(
                        "KV events lost; the cache view starts over",
                        shard=source.shard_id,
                        after=last_seq,
                        got=seq,
                    )
                    self._receive(source, CacheDelta(cleared=True))
                last_seq = seq
                try:
                    self._receive(source, decode_batch(parts[2]))
                except ValueError as err:
                    log.warning("unreadable KV event batch", shard=source.shard_id, error=str(err))
        finally:
            sock.close()

    def _reconcile(self) -> None:
        wanted = set(self.sources())
        for gone in set(self._subscribers) - wanted:
            self._subscribers.pop(gone).cancel()
            self._pending.pop(gone, None)
        for new in wanted - set(self._subscribers):
            # A new engine (or a restarted one): whatever was known of its cache is void.
            self._pending[new] = CacheDelta(cleared=True)
            self._subscribers[new] = asyncio.create_task(
                self._subscribe(new), name=f"kv events {new.shard_id}"
            )

    def flush(self) -> list[v1.CacheEvents]:
        """Send what each engine's cache did since the last flush (only while a stream is up)."""
        session = self.session()
        if session == 0:
            return []
        if session != self._session:
            self._session = session
            for source in self._subscribers:
                self._pending[source] = CacheDelta(cleared=True)
        out = []
        for source, delta in list(self._pending.items()):
            if not delta:
                continue
            message = v1.CacheEvents(
                shard_id=source.shard_id,
                stored=delta.stored,
                removed=delta.removed,
                cleared=delta.cleared,
                block_size=delta.block_size,
                generation=source.generation,
            )
            self.send(message)
            out.append(message)
            self._pending[source] = CacheDelta(block_size=delta.block_size)
        self.relayed += len(out)
        return out

    async def run(self) -> None:
        try:
            while True:
                self._reconcile()
                self.flush()
                await asyncio.sleep(max(0.01, self.interval()))
        finally:
            for task in self._subscribers.values():
                task.cancel()
            for task in self._subscribers.values():
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
