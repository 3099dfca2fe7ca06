"""The controller's state in the store: restore at start (or takeover), keep it written.

The controller calls :meth:`StateKeeper.node_changed` on every Register, shard status
and disconnect (never on a heartbeat) and :meth:`StateKeeper.after_pass`, with what it
holds, after each reconcile pass; the keeper turns what changed into records for the
:class:`~llmgw_control.store.persist.Persister`. It holds no reference to the
controller: what it writes is passed in, what it reads back is handed out
(:meth:`load`), and the controller applies it. Without a store it does nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import structlog
from prometheus_client import CollectorRegistry

from llmgw_control.inventory import Node, NodeState
from llmgw_control.records import ControlState
from llmgw_control.store.base import Change, Records, Store
from llmgw_control.store.persist import (
    META,
    NODE,
    PUBLISH,
    REPLICA,
    Clock,
    Persister,
    Restored,
    StoreMetrics,
    decode_state,
    encode_node,
    encode_publish,
    encode_replaced,
    encode_replica,
)

__all__ = ["StateKeeper", "adoptable", "known_nodes"]

log = structlog.get_logger(__name__)


class StateKeeper:
    def __init__(
        self, store: Store | None = None, registry: CollectorRegistry | None = None
    ) -> None:
        self.store = store
        self.persister: Persister | None = None
        self._dirty_nodes: set[str] = set()
        self._published = -1
        self._replaced: bytes = b""
        # One mapping of monotonic to wall time for the whole process, so the same
        # record always encodes to the same bytes (unchanged records are not written).
        self.clock = Clock.now()
        # Records of kinds the controller does not own (override, rollout, ...).
        self.other: Records = {}
        if store is not None:
            self.persister = Persister(
                store, StoreMetrics(registry) if registry is not None else None
            )

    @property
    def enabled(self) -> bool:
        return self.persister is not None and self.persister.enabled

    # --- the generic keyed records (rollouts, overrides, ...) -------------------------

    def get(self, kind: str, key: str) -> bytes | None:
        return self.other.get(kind, {}).get(key)

    def records(self, kind: str) -> dict[str, bytes]:
        return dict(self.other.get(kind, {}))

    def put(self, kind: str, key: str, value: bytes | None) -> None:
        """Keep ``value`` under (kind, key) (None deletes it); written with the next batch."""
        if kind in (NODE, REPLICA, PUBLISH):
            raise ValueError(f"record kind {kind!r} belongs to the controller")
        if value is None:
            self.other.get(kind, {}).pop(key, None)
        else:
            self.other.setdefault(kind, {})[key] = value
        if self.persister is not None:
            self.persister.stage(kind, key, value)

    # --- start and takeover -----------------------------------------------------------

    async def load(self) -> Restored:
        """Read and decode everything: a StoreError here must stop the start.

        Every known node comes back UNREACHABLE as if its stream just dropped (with the
        nodes restored replicas run on); replicas are kept.
        """
        assert self.store is not None
        records = await self.store.load()
        restored = decode_state(records, self.clock.at_now(), self.store.description)
        assert self.persister is not None
        self.persister.seed(records)
        missing = known_nodes(restored, time.monotonic())
        adoptable(restored)
        if missing:
            log.warning(
                "replicas on nodes the store has no record of; those nodes start UNREACHABLE",
                nodes=len(missing),
                first=missing[0],
            )
        return restored

    def restored(self, restored: Restored, published: int) -> None:
        """The controller applied ``restored``; it publishes ``published`` (a version)."""
        self.other = restored.other
        self._published = published

    def reset(self) -> None:
        """Forget what was staged and kept (a standby that lost or gave up the lead)."""
        self._dirty_nodes.clear()
        self.other = {}
        if self.persister is not None:
            self.persister = Persister(self.persister.store, self.persister.metrics)

    def writing(self, on: bool) -> None:
        """Write (leading) or drop every change (standing by)."""
        if self.persister is not None:
            self.persister.enabled = on

    # --- changes ----------------------------------------------------------------------

    def node_changed(self, node_id: str) -> None:
        if self.persister is not None:
            self._dirty_nodes.add(node_id)

    def after_pass(
        self,
        nodes: Mapping[str, Node],
        state: ControlState,
        publish_version: int,
        endpoints: Iterable[tuple[Any, ...]],
    ) -> None:
        """Stage what changed of the nodes, the replicas and the published endpoints."""
        p = self.persister
        if p is None or not p.enabled:
            return
        clock = self.clock
        for node_id in self._dirty_nodes:
            node = nodes.get(node_id)
            p.stage(NODE, node_id, encode_node(node, clock) if node is not None else None)
        self._dirty_nodes.clear()
        # LOST nodes stay known (an agent may come back); nodes pruned away are deleted.
        for gone in p.known(NODE) - nodes.keys():
            p.stage(NODE, gone, None)
        replicas = state.replicas
        for rid, r in replicas.items():
            p.stage(REPLICA, rid, encode_replica(r, clock))
        for gone in p.known(REPLICA) - replicas.keys():
            p.stage(REPLICA, gone, None)
        replaced = encode_replaced(state.replaced, clock)
        if replaced != self._replaced:
            self._replaced = replaced
            p.stage(META, "replaced", replaced)
        if publish_version != self._published:
            self._published = publish_version
            p.stage(PUBLISH, "current", encode_publish(publish_version, endpoints))

    async def durable(self, timeout: float) -> bool:
        """Everything staged so far is in the store (True at once without a store)."""
        p = self.persister
        if p is None or not p.enabled:
            return True
        return await p.durable(timeout)

    async def write_now(self, changes: list[Change]) -> None:
        assert self.store is not None
        await self.store.write(changes)


def known_nodes(restored: Restored, now: float) -> list[str]:
    """A node a restored replica runs on is a known node, even without a record of its
    own (the replica was stored, the node's record not yet, when the last control plane
    died): it starts UNREACHABLE like the others, so its replicas are replaced only
    ``lost_after`` from now, not at once. Its Register fills it in. The ids added."""
    added: list[str] = []
    for replica in restored.replicas.values():
        for plan in replica.shards:
            if plan.node_id not in restored.nodes:
                restored.nodes[plan.node_id] = Node(
                    node_id=plan.node_id,
                    session_id="",
                    connected=False,
                    last_seen=now,
                    state=NodeState.UNREACHABLE,
                )
                added.append(plan.node_id)
    return added


def adoptable(restored: Restored) -> int:
    """A replica stored before it was placed (the control plane died before it wrote the
    placement) takes the shard an agent reports for it, as an adopted one does: the
    agent runs what the lost placement started. Without this the shard would be an
    orphan and stopped. How many such replicas."""
    count = 0
    for replica in restored.replicas.values():
        if not replica.shards and not replica.draining:
            replica.adopted = True
            count += 1
    return count
