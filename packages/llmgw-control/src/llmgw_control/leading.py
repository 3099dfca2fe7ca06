"""How ``serve`` runs the controller with its state store, alone or as one of several.

Alone (no ``ha:``): the store is opened and read before anything listens (a store
that cannot be read stops the start), the epoch is bumped, the state restored, and
the reconciler runs. With ``ha:``: the store is opened and read the same way, then
the instance campaigns; while standing by it refuses agent streams and watches with
the leader's address; when elected it reloads the state, takes the new epoch and
starts reconciling; when it loses the lead it stops dispatching at once, ends every
stream and forgets what it held, and campaigns again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
from prometheus_client import Gauge

from llmgw_control.agent_service import admitted_while_deposed
from llmgw_control.config import ControlConfig, split_hostport
from llmgw_control.controller import Controller
from llmgw_control.leader_gate import LeaderGate
from llmgw_control.leadership import Leadership, default_instance_id
from llmgw_control.store import Change, Store, leader_backend, make_store
from llmgw_control.store.keeper import StateKeeper
from llmgw_control.store.persist import META

__all__ = ["Leading"]

log = structlog.get_logger(__name__)


class Leading:
    def __init__(
        self, controller: Controller, config: ControlConfig, config_path: Path | None
    ) -> None:
        self.controller = controller
        self.config = config
        self.store: Store = make_store(config.state, config_path)
        self.keeper = StateKeeper(self.store, controller.metrics.registry)
        controller.keeper = self.keeper
        self.leadership: Leadership | None = None
        self.gate: LeaderGate | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._serving = False
        self._reconciler: asyncio.Task[None] | None = None
        self._persist: asyncio.Task[None] | None = None
        # Told when the state was read back (start, takeover) and when it is forgotten
        # (standing by): what keeps records of its own beside the controller (keys).
        self.on_restored: list[Callable[[StateKeeper], None]] = []
        self.on_forgotten: list[Callable[[], None]] = []
        registry = controller.metrics.registry
        self.leader_gauge = Gauge(
            "llmgw_control_leader", "1 while this instance leads (dispatches).", registry=registry
        )
        self.epoch_gauge = Gauge(
            "llmgw_control_epoch", "The epoch this instance leads with.", registry=registry
        )
        ha = config.ha
        if ha is not None:
            host, port = split_hostport(config.listen)
            instance = ha.instance_id or default_instance_id(config.listen)
            address = ha.advertise or f"{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
            # The config has the state on ha.backend (checked when loaded).
            backend = leader_backend(self.store, instance, address, float(ha.lease_ttl))
            self.leadership = Leadership(backend, ha, instance, address, self._elected, self._lost)
            lead = self.leadership
            Gauge(
                "llmgw_control_lease_longest_gap_seconds",
                "Longest time between two good lease renewals while leading (renewed on a "
                "thread of its own; a gap near lease_ttl means the lead was nearly lost).",
                registry=registry,
            ).set_function(lambda: lead.longest_gap)
            self.gate = LeaderGate(
                [], lambda: self._leading(), lambda: self._leader(), admitted_while_deposed
            )
            # Nothing goes out before this instance is elected, nor past its lease.
            controller.agents.dispatching = False
            controller.agents.lease_valid = self.leadership.valid

    def _leading(self) -> bool:
        """Serving as the leader: elected, and the takeover (state read back) done.

        Until the takeover is done the gate refuses streams and watches (naming this
        instance as the leader, so they come back at once): an agent that registered
        while the state was being read would be overwritten by the restore.
        """
        return self.leadership is None or (self.leadership.leading and self._serving)

    def _leader(self) -> str:
        return self.leadership.leader_address if self.leadership is not None else ""

    def services(self, services: list[Any]) -> list[Any]:
        if self.gate is None:
            return services
        self.gate.services = services
        return [self.gate]

    async def open(self) -> None:
        """Open and read the store; StoreError (the start must stop) if it cannot be read."""
        await self.store.open()
        restored = await self.keeper.load()
        if self.leadership is None:
            # Newer than the last one, and than the wall clock's seconds: newer than any
            # epoch an agent saw, even if the state file was lost.
            epoch = max(int(self.keeper.get(META, "epoch") or b"0") + 1, int(time.time()))
            await self.store.write([Change(META, "epoch", str(epoch).encode())])
            self.keeper.other.setdefault(META, {})["epoch"] = str(epoch).encode()
            self._epoch(epoch)
            self.controller.restore(restored)
            self._restored()
        else:
            log.info(
                "state readable; campaigning for the lead",
                store=self.store.description,
                nodes=len(restored.nodes),
                replicas=len(restored.replicas),
            )
            # A standby holds nothing: the state is read again when it is elected.
            self.controller.follow()
            self._forgotten()

    def _restored(self) -> None:
        for hook in self.on_restored:
            hook(self.keeper)

    def _forgotten(self) -> None:
        for hook in self.on_forgotten:
            hook()

    def _epoch(self, epoch: int) -> None:
        self.controller.agents.epoch = epoch
        self.epoch_gauge.set(epoch)

    def start(self) -> None:
        if self.leadership is None:
            self.leader_gauge.set(1)
            self._start_leading()
        else:
            self._tasks.append(asyncio.create_task(self.leadership.run()))

    def _start_leading(self) -> None:
        assert self.keeper.persister is not None
        self.controller.lead()
        self._persist = asyncio.create_task(self.keeper.persister.run())
        self._reconciler = asyncio.create_task(self.controller.run())

    async def _elected(self, epoch: int) -> None:
        c = self.controller
        c.follow()
        self.keeper.persister.on_not_leader = self._fenced  # type: ignore[union-attr]
        restored = await self.keeper.load()
        c.restore(restored)
        self._restored()
        self._epoch(epoch)
        self.leader_gauge.set(1)
        self._start_leading()
        self._serving = True

    def _fenced(self) -> None:
        assert self.leadership is not None
        self.leadership.step_down("a write was fenced")

    def _lost(self, why: str) -> None:
        # At once, before anything else can run: nothing more is dispatched or written,
        # and what was held is forgotten.
        self.controller.follow()
        self._forgotten()
        self._serving = False
        self.leader_gauge.set(0)
        for task in (self._reconciler, self._persist):
            if task is not None:
                task.cancel()
        self._reconciler = self._persist = None
        if self.gate is not None:
            self.gate.end_all(why)

    async def stop(self) -> None:
        if self._reconciler is not None:
            self._reconciler.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reconciler
        # The last writes go out while the lease is still renewed (on its own thread).
        if self.keeper.persister is not None and self._leading():
            if self._persist is not None:
                self._persist.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self._persist
            self.controller.stage_state()
            await self.keeper.persister.flush()
        if self.leadership is not None:
            await self.leadership.resign()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.store.close()
