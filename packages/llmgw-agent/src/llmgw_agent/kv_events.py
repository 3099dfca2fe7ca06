"""KV-cache events: which prefix blocks an engine stored and evicted, relayed upstream.

vLLM (and SGLang, in the same format) publish them when a profile asks for it with
``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557"}'``: a ZMQ PUB socket sending ``(topic, seq: 8 bytes big-endian,
payload)`` where the payload is a msgpack ``[ts, [event, ...], dp_rank]`` and each event is
a tagged struct: ``BlockStored`` (block_hashes, parent_block_hash, token_ids, block_size,
...), ``BlockRemoved`` (block_hashes, ...) or ``AllBlocksCleared``.

The agent subscribes on loopback, keeps each engine's cached blocks (``CacheView``) and
relays what changed compactly as CacheEvents, batched per interval. A block whose event
carries its token ids (vLLM's do) is named by ``llmgw_proto.token_blocks``' hash of them
(``token_hashes``), which a router that tokenizes a prompt can compute; otherwise by the
engine's own hash as a 64-bit integer (a sha256 hash keeps its low 64 bits, as vLLM's
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` does). A gap in the sequence numbers or a
restarted engine sends ``cleared`` so the receiver forgets that engine's blocks rather
than trusting a view with holes in it; a new stream sends everything held now.
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
from llmgw_proto.token_blocks import block_hash, root

from llmgw_agent.engine_flags import ParsedArgs

__all__ = [
    "CacheDelta",
    "CacheView",
    "KvEvent",
    "KvEventsRelay",
    "KvSource",
    "decode_batch",
    "decode_events",
    "kv_events_target",
    "loopback_kv_config",
]

log = structlog.get_logger(__name__)

_MASK = (1 << 64) - 1


# What engines publish on when the config names no endpoint (vLLM's default): every
# address of the node. The agent makes it loopback.
_DEFAULT_ENDPOINT = "tcp://*:5557"
_WILDCARDS = ("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:", "tcp://:::")
_LOOPBACK = ("tcp://127.0.0.1:", "tcp://localhost:", "tcp://[::1]:")


def _publishes(config: object) -> bool:
    return (
        isinstance(config, dict)
        and bool(config.get("enable_kv_cache_events"))
        and config.get("publisher", "zmq") == "zmq"
    )


def loopback_endpoint(endpoint: str) -> str | None:
    """``endpoint`` on loopback: a wildcard becomes 127.0.0.1, loopback and ipc:// stay;
    None for an address other machines could reach (the events carry every cached
    prompt's token ids)."""
    for wildcard in _WILDCARDS:
        if endpoint.startswith(wildcard):
            return "tcp://127.0.0.1:" + endpoint[len(wildcard) :]
    if endpoint.startswith((*_LOOPBACK, "ipc://", "inproc://")):
        return endpoint
    return None


def loopback_kv_config(raw: str) -> tuple[str, str]:
    """(the config with its endpoint on loopback, problem): a problem naming the endpoint
    when the profile asks for another machine's address. A config that publishes nothing
    comes back as it was. (At launch the agent gives the engine an ipc:// socket.)"""
    try:
        config = json.loads(raw)
    except ValueError:
        return raw, ""
    if not _publishes(config):
        return raw, ""
    endpoint = str(config.get("endpoint") or _DEFAULT_ENDPOINT)
    local = loopback_endpoint(endpoint)
    if local is None:
        return raw, (
            f"engine_args --kv-events-config: endpoint {endpoint!r} would publish the token "
            "ids of every cached prompt where other machines can read them; use "
            "tcp://*:0 (the agent gives the engine a Unix socket of its own)"
        )
    if local == config.get("endpoint"):
        return raw, ""
    return json.dumps({**config, "endpoint": local}), ""


def kv_events_target(parsed: ParsedArgs) -> tuple[str, str] | None:
    """(endpoint to connect to on loopback, topic) when engine_args publish KV events."""
    raw = parsed.first("--kv-events-config")
    if raw is None:
        return None
    try:
        config = json.loads(raw)
    except ValueError:
        return None
    if not _publishes(config):
        return None
    endpoint = str(config.get("endpoint") or _DEFAULT_ENDPOINT)
    local = loopback_endpoint(endpoint)
    if local is None:
        return None  # refused by validation (loopback_kv_config names it)
    return local, str(config.get("topic") or "")


def _hash(value: object) -> int | None:
    if isinstance(value, bytes):
        return int.from_bytes(value, "big") & _MASK
    if isinstance(value, int) and not isinstance(value, bool):
        return value & _MASK
    return None


_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
}
# The KV-cache groups a prompt's prefix is cached in. A sliding-window or Mamba group of
# a hybrid model (gemma-3's local layers) keeps only a window or a state: its blocks say
# nothing about which prefix a full prefill can skip.
_PREFIX_KINDS = {None, "full_attention", "mla_attention", "sink_full_attention"}


def _fields(event: Any) -> tuple[str, dict[str, Any]]:
    """(type, fields) of one event, map-encoded (``{"type": ...}``) or array-encoded."""
    if isinstance(event, dict):
        return str(event.get("type", "")), event
    if isinstance(event, list) and event and isinstance(event[0], str):
        kind, rest = event[0], event[1:]
        return kind, dict(zip(_FIELDS.get(kind, ()), rest, strict=False))
    return "", {}


@dataclass
class CacheDelta:
    """What one engine's cache did since the last relay."""

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    cleared: bool = False
    block_size: int = 0
    # stored/removed are token_blocks hashes of the blocks' token ids, not the engine's.
    token_hashes: bool = False

    def add(self, other: CacheDelta) -> None:
        if other.cleared:
            # Everything before a clear is moot.
            self.stored, self.removed, self.cleared = [], [], True
        self.stored += other.stored
        self.removed += other.removed
        self.block_size = other.block_size or self.block_size
        self.token_hashes = self.token_hashes or other.token_hashes

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.cleared)


@dataclass(frozen=True)
class KvEvent:
    """One decoded event: ``BlockStored``, ``BlockRemoved`` or ``AllBlocksCleared``."""

    kind: str
    hashes: tuple[int, ...] = ()
    parent: int | None = None
    tokens: tuple[int, ...] = ()
    block_size: int = 0
    group: int | None = None
    spec_kind: str | None = None
    lora_name: str | None = None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def decode_events(payload: bytes) -> list[KvEvent]:
    """One published batch's events; ValueError when it is not a KV event batch."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as err:
        raise ValueError(f"not msgpack: {err}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not a KV event batch: expected [ts, events, ...]")
    out = []
    for event in batch[1]:
        kind, fields = _fields(event)
        if kind not in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
            continue
        hashes = tuple(h for h in map(_hash, fields.get("block_hashes") or []) if h is not None)
        tokens = fields.get("token_ids") or []
        spec_kind = fields.get("kv_cache_spec_kind")
        lora = fields.get("lora_name")
        out.append(
            KvEvent(
                kind=kind,
                hashes=hashes,
                parent=_hash(fields.get("parent_block_hash")),
                tokens=tuple(t for t in tokens if isinstance(t, int)),
                block_size=_int(fields.get("block_size")) or 0,
                group=_int(fields.get("group_idx")),
                spec_kind=spec_kind if isinstance(spec_kind, str) else None,
                lora_name=lora if isinstance(lora, str) else None,
            )
        )
    return out


class CacheView:
    """One engine's cached prefix blocks, as the agent names them, from its events.

    A stored block whose event carries its token ids is named by ``token_blocks``' hash
    of them, chained from its parent's name (the engine's parent hash, looked up here):
    what a router that tokenizes the prompt computes too. Without token ids (an engine
    that does not send them) the engine's own hash stands. A block held by two groups,
    or stored again when reused, is relayed once and removed when the last copy goes.
    Blocks of a group that caches no prefix (sliding window, Mamba) are left out.
    """

    def __init__(self) -> None:
        self._names: dict[tuple[int | None, int], int] = {}
        self._refs: dict[int, int] = {}
        self._skipped_groups: set[int | None] = set()
        self.block_size = 0
        self.token_hashes = False

    def __len__(self) -> int:
        return len(self._refs)

    def clear(self) -> None:
        self._names.clear()
        self._refs.clear()

    def snapshot(self) -> CacheDelta:
        """Everything held now, as a delta that replaces what a receiver knew."""
        return CacheDelta(
            stored=list(self._refs),
            cleared=True,
            block_size=self.block_size,
            token_hashes=self.token_hashes,
        )

    def apply(self, events: Iterable[KvEvent]) -> CacheDelta:
        delta = CacheDelta(block_size=self.block_size, token_hashes=self.token_hashes)
        for event in events:
            if event.kind == "AllBlocksCleared":
                self.clear()
                delta.add(CacheDelta(cleared=True))
            elif event.kind == "BlockStored":
                self._store(event, delta)
            else:
                self._remove(event, delta)
        delta.block_size = self.block_size
        delta.token_hashes = self.token_hashes
        return delta

    def _store(self, event: KvEvent, delta: CacheDelta) -> None:
        if event.spec_kind not in _PREFIX_KINDS:
            self._skipped_groups.add(event.group)
            return
        if event.group in self._skipped_groups:
            return
        size = event.block_size or self.block_size
        if event.block_size:
            self.block_size = event.block_size
        names = self._names
        group = event.group
        if event.tokens and size and len(event.tokens) == size * len(event.hashes):
            self.token_hashes = True
            if event.parent is None:
                parent: int | None = root(event.lora_name)
            else:
                parent = names.get((group, event.parent))
            if parent is None:
                # Its parent was never seen (stored before the subscription, or already
                # evicted): no name reaches it, and no prompt's chain could match it.
                return
            for i, engine_hash in enumerate(event.hashes):
                parent = block_hash(parent, event.tokens[i * size : (i + 1) * size])
                self._hold(group, engine_hash, parent, delta)
        else:
            for engine_hash in event.hashes:
                self._hold(group, engine_hash, engine_hash, delta)

    def _hold(self, group: int | None, engine_hash: int, name: int, delta: CacheDelta) -> None:
        key = (group, engine_hash)
        if key in self._names:
            return  # stored again (reused from the cache): already held
        self._names[key] = name
        refs = self._refs.get(name, 0)
        self._refs[name] = refs + 1
        if refs == 0:
            delta.stored.append(name)

    def _remove(self, event: KvEvent, delta: CacheDelta) -> None:
        for engine_hash in event.hashes:
            name = self._names.pop((event.group, engine_hash), None)
            if name is None:
                continue
            refs = self._refs[name] - 1
            if refs:
                self._refs[name] = refs
            else:
                del self._refs[name]
                delta.removed.append(name)


def decode_batch(payload: bytes) -> CacheDelta:
    """One published batch as a delta, from an empty view; ValueError when it is not one."""
    return CacheView().apply(decode_events(payload))


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
        self._views: dict[KvSource, CacheView] = {}
        self._session = 0
        self.relayed = 0

    def _receive(self, source: KvSource, delta: CacheDelta) -> None:
        self._pending.setdefault(source, CacheDelta()).add(delta)

    def view(self, source: KvSource) -> CacheView:
        view = self._views.get(source)
        if view is None:
            view = self._views[source] = CacheView()
        return view

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
                    self.view(source).clear()
                    self._receive(source, CacheDelta(cleared=True))
                last_seq = seq
                try:
                    self._receive(source, self.view(source).apply(decode_events(parts[2])))
                except ValueError as err:
                    log.warning("unreadable KV event batch", shard=source.shard_id, error=str(err))
        finally:
            sock.close()

    def _reconcile(self) -> None:
        wanted = set(self.sources())
        for gone in set(self._subscribers) - wanted:
            self._subscribers.pop(gone).cancel()
            self._pending.pop(gone, None)
            self._views.pop(gone, None)
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
            # A new stream: the control plane starts from what each engine holds now.
            for source in self._subscribers:
                self._pending[source] = self.view(source).snapshot()
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
                token_hashes=delta.token_hashes,
            )
            self.send(message)
            out.append(message)
            self._pending[source] = CacheDelta(
                block_size=delta.block_size, token_hashes=delta.token_hashes
            )
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
