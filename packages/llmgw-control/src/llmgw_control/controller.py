"""The control plane process: inventory, reconciler, agent and publish services, wired.

Agent events update the inventory and wake the reconcile loop; the loop runs the
pure :func:`~llmgw_control.reconciler.reconcile` on every wake-up and at least every
``interval``, hands its commands to the agent service, and publishes the ready
endpoints. Everything runs on one event loop, so no locks.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import gc
import itertools
import secrets
import time
from typing import Any

import structlog
from llmgw_proto import tracing, v1

from llmgw_control import ops as operations
from llmgw_control import status as status_view
from llmgw_control import traces
from llmgw_control.agent_service import AgentService, Session
from llmgw_control.autoscaler import Autoscaler
from llmgw_control.bounds import admit_shard, clip_status, status_problem
from llmgw_control.catalog import Catalog
from llmgw_control.config import ControlConfig, ControlSettings, Loaded
from llmgw_control.history import History, ModelFigures, RequestIntake, model_rows
from llmgw_control.inventory import Inventory, NodeState
from llmgw_control.leaving import publishes_leaving
from llmgw_control.loads import Figures
from llmgw_control.lora import LoraManager
from llmgw_control.metrics import Metrics, failures_by_profile
from llmgw_control.publish import (
    DeclaredInfo,
    EndpointInfo,
    Publisher,
    address_problem,
    engine_generation,
)
from llmgw_control.reconciler import Settings, reconcile
from llmgw_control.records import (
    Command,
    ControlState,
    Drain,
    Start,
    Stop,
    replica_state,
    unsend,
)
from llmgw_control.slots import slot_name
from llmgw_control.store.keeper import StateKeeper
from llmgw_control.store.persist import Restored

__all__ = ["Controller", "keep_heap", "settings_of", "watch_loop_lag"]

log = structlog.get_logger(__name__)

ENGINES = {
    "vllm": v1.EngineKind.VLLM,
    "sglang": v1.EngineKind.SGLANG,
    "llamacpp": v1.EngineKind.LLAMACPP,
}
# vLLM, SGLang and llama-server all answer their health check here.
HEALTH_PATH = "/health"
RESYNC = 60.0
# How long a pass's commands wait for its records to be stored before they go anyway
# (a store that is down must not stop the fleet being looked after).
WRITE_AHEAD = 2.0


def settings_of(c: ControlSettings) -> Settings:
    return Settings(
        port_range=c.port_range,
        mgmt_interface=c.mgmt_interface,
        base_backoff=c.base_backoff,
        max_backoff=c.max_backoff,
        drain_timeout=c.drain_timeout,
        warm_before_drain=c.warm_before_drain,
        stop_grace=c.stop_grace,
        startup_grace=c.startup_grace,
        adopt_grace=c.lost_after,
    )


async def keep_heap(freeze_every: float = 5.0, sweep_every: float = 3600.0) -> None:
    """Keep Python's full garbage collections short on a large fleet.

    Thousands of open streams mean millions of long-lived objects, and a full
    collection walks them all: pauses of hundreds of milliseconds, during which no
    heartbeat is read. Freezing the survivors now and then takes them out of every
    later collection; an hourly sweep (unfreeze, collect, freeze) reclaims the few
    reference cycles that died after being frozen.
    """
    sweep_at = time.monotonic() + sweep_every
    while True:
        await asyncio.sleep(freeze_every)
        if time.monotonic() >= sweep_at:
            sweep_at = time.monotonic() + sweep_every
            gc.unfreeze()
            gc.collect()
        # O(1): moves every tracked object to the permanent generation.
        gc.freeze()


async def watch_loop_lag(metrics: Metrics, every: float = 0.05) -> None:
    """Sample event-loop lag: the part of any latency that is the control plane's own."""
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time()
        await asyncio.sleep(every)
        metrics.loop_lag.observe(max(loop.time() - asked - every, 0.0))


class Controller:
    def __init__(self, loaded: Loaded) -> None:
        self.config: ControlConfig = loaded.config
        # What the config says, and what runs: the config with the operator's overrides
        # (llmgw_control.ops: scale, rollout undo) applied, as every pass sees it.
        self.config_catalog: Catalog = loaded.catalog
        self.catalog: Catalog = loaded.catalog
        self.ops = operations.Ops()
        self._deadlines_passed: set[float] = set()
        self.settings = settings_of(self.config.control)
        self.metrics = Metrics()
        self.inventory = Inventory()
        self.state = ControlState(started_at=time.monotonic())
        self.started = dt.datetime.now(dt.UTC)
        # The last refused reload, {at, error}, until one succeeds (status, the page).
        self.reload_refused: dict[str, str] | None = None
        # An hour of per-model figures for the status page (cli.serve runs the sampler).
        self.history = History()
        # The routers' ReportRequests, summed per model between samples.
        self.requests_in = RequestIntake()
        self.publisher = Publisher(self.metrics)
        self.publisher.on_demand = self.on_demand
        self.agents = AgentService(
            self,
            heartbeat_interval=self.config.control.heartbeat_interval,
            command_timeout=self.config.control.command_timeout,
            metrics=self.metrics,
        )
        self._wake = asyncio.Event()
        self._sent: dict[str, Command] = {}
        # Commands of the last pass, held until its records are stored (write-ahead).
        self._outbox: list[Command] = []
        self._ids = itertools.count(1)
        self._prefix = secrets.token_hex(3)
        # A pass is skipped while nothing changed and no deadline is due; the
        # reconciler still runs in full every RESYNC seconds, whatever happened.
        self._dirty = True
        self._next_at = 0.0
        self._resync_at = 0.0
        self.ticks = 0
        # model -> when a router last said it holds requests for it (ReportDemand).
        self.demand: dict[str, float] = {}
        # Replica counts the autoscaler wants, and the rollouts the last pass saw.
        self.autoscaler = Autoscaler()
        self._wanted: dict[tuple[str, str], int] = {}
        self.rollouts: dict[tuple[str, str], dict[str, Any]] = {}
        self.agents.load_interval = float(self.config.control.load_interval)
        # replica id -> why routers may not reach its published URL (logged once each).
        self.address_problems: dict[str, str] = {}
        self.metrics.count_fleet(self.node_counts, self.replica_counts)
        self.metrics.count_lifecycle(lambda: self.autoscaler.reasons, lambda: self.rollouts)
        self.metrics.count_failures(
            lambda: failures_by_profile(
                (p.key for p in self.catalog.profiles), self.state.replicas.values()
            )
        )
        # The state store (none until serve sets one): restores and writes what must
        # not be forgotten; see llmgw_control.store.keeper.
        self.keeper = StateKeeper()
        # LoRA adapters: demand from routers, loads and unloads on the engines (issue 30).
        self.lora = LoraManager(self.metrics.registry)
        # An adapter being unloaded is hidden from routers first (llmgw_control.lora).
        self.publisher.loads.hidden_adapters = self.lora.hidden
        self.lora.touch = self.publisher.loads.touch_endpoint

    # --- the lead and the state store -----------------------------------------------

    def lead(self) -> None:
        """Dispatch and write the state from now on (alone, or elected)."""
        self.keeper.writing(True)
        self.agents.dispatching = True

    def follow(self) -> None:
        """Stand by: nothing more is dispatched or written, and what was held is forgotten."""
        self.agents.dispatching = False
        self.forget()
        self.publisher.primed.clear()

    def forget(self) -> None:
        """Hold nothing (the state is read again on being elected); writes stay off."""
        self.inventory = Inventory()
        self.state = ControlState(started_at=time.monotonic())
        self.ops = operations.Ops()
        self.catalog = self.config_catalog
        self.keeper.reset()
        self.keeper.writing(False)

    def restore(self, restored: Restored) -> None:
        """Take back what the store held: its nodes (UNREACHABLE), replicas, endpoints."""
        self.inventory.nodes.update(restored.nodes)
        self.state.replicas.update(restored.replicas)
        self.state.replaced.update(restored.replaced)
        publisher = self.publisher
        if restored.publish_version:
            publisher.version = max(publisher.version, restored.publish_version + 1)
        if not restored.empty:
            # What ran before is known: publish it from the first snapshot on, rather than
            # wait out the startup grace with nothing for the routers.
            publisher.update(self.endpoints())
            publisher.primed.set()
        self.keeper.restored(restored, publisher.version)
        self.ops, problems = operations.decode(restored.other.get(operations.KIND, {}))
        for problem in problems:
            log.warning("stored override unreadable; ignored", problem=problem)
        self.catalog = operations.effective_catalog(self.config_catalog, self.ops)
        store = self.keeper.store
        log.info(
            "state restored",
            store=store.description if store is not None else None,
            nodes=len(restored.nodes),
            replicas=len(restored.replicas),
            endpoints=len(publisher.endpoints),
            publish_version=publisher.version,
            overrides=len(operations.encode(self.ops)),
        )

    def set_ops(self, new: operations.Ops) -> None:
        """Take the operator's overrides ``new``: kept in the store, applied from the next pass."""
        for key, value in operations.changes(self.ops, new).items():
            self.keeper.put(operations.KIND, key, value)
        self.ops = new
        self.catalog = operations.effective_catalog(self.config_catalog, new)
        self._changed()

    def _on_nodes(self) -> dict[str, list[str]]:
        return {
            rid: [p.node_id for p in r.shards]
            for rid, r in self.state.replicas.items()
            if not r.draining
        }

    def stage_state(self) -> None:
        """Hand the keeper what it writes: nodes, replicas, the published endpoints."""
        self.keeper.after_pass(
            self.inventory.nodes, self.state, self.publisher.version, self.publisher.endpoints
        )

    # --- agent events ---------------------------------------------------------------

    def on_register(self, session: Session, msg: v1.Register) -> None:
        self.inventory.register(msg, session.session_id, session.peer_host, time.monotonic())
        self.keeper.node_changed(session.node_id)
        self._changed()

    def on_heartbeat(self, session: Session, msg: v1.Heartbeat) -> None:
        node = self.inventory.nodes.get(session.node_id)
        if node is not None and len(msg.gpus) > len(node.gpus):
            # Figures only for the GPUs the node registered: no more entries than those.
            registered = {g.index for g in node.gpus}
            msg.gpus = [g for g in msg.gpus if g.index in registered][: len(node.gpus)]
        self.inventory.heartbeat(session.node_id, session.session_id, msg, time.monotonic())
        self.publisher.loads.heard(session.node_id, time.monotonic())
        node = self.inventory.nodes.get(session.node_id)
        if node is not None and node.state != NodeState.READY:
            self._wake.set()

    def on_shard_status(self, session: Session, msg: v1.ShardStatus) -> None:
        bounds = self.agents.bounds
        problem = status_problem(msg, bounds)
        if problem is not None:
            session.dropped += 1
            self.metrics.refusals.labels("agent", "shard status too large").inc()
            log.warning(
                "shard status dropped",
                node_id=session.node_id,
                peer=session.peer_host,
                why=problem,
            )
            return
        node = self.inventory.nodes.get(session.node_id)
        if node is not None and not admit_shard(
            held=len(node.shards),
            known=msg.shard_id in node.shards,
            # Only asked (all replicas' shards) when the node is at its bound: rare.
            asked=len(node.shards) >= bounds.shards and msg.shard_id in self._asked(),
            bounds=bounds,
        ):
            session.dropped += 1
            self.metrics.refusals.labels("agent", "shard not asked for").inc()
            if session.dropped == 1 or session.dropped % 1000 == 0:
                log.warning(
                    "shard status dropped: the node holds too many shards it was not asked to run",
                    node_id=session.node_id,
                    peer=session.peer_host,
                    shard_id=msg.shard_id[:80],
                    held=len(node.shards),
                    dropped=session.dropped,
                )
            return
        clip_status(msg, bounds)
        traces.shard_status(session.node_id, msg)
        self.inventory.shard_status(session.node_id, session.session_id, msg, time.monotonic())
        self.keeper.node_changed(session.node_id)
        log.info(
            "shard status",
            node_id=session.node_id,
            shard_id=msg.shard_id,
            state=v1.ShardState(msg.state).name,
            reason=msg.reason or None,
        )
        self._changed()

    def _asked(self) -> set[str]:
        """Every shard the control plane plans to run somewhere."""
        return {p.shard_id for r in self.state.replicas.values() for p in r.shards}

    def _current(self, session: Session) -> bool:
        node = self.inventory.nodes.get(session.node_id)
        return node is not None and node.session_id == session.session_id

    def on_load_report(self, session: Session, msg: v1.LoadReport) -> None:
        if self._current(session):
            self.publisher.loads.report(session.node_id, msg, time.monotonic())

    def on_cache_events(self, session: Session, msg: v1.CacheEvents) -> None:
        if self._current(session):
            self.publisher.loads.cache_events(session.node_id, msg, time.monotonic())

    def on_demand(self, request: v1.DemandRequest) -> v1.DemandReply:
        """A router holds requests for a model (ReportDemand), or asks for an adapter."""
        if self.catalog.adapter(request.model) is not None:
            self.lora.on_demand(request.model, request.held, request.requests, time.monotonic())
            if request.held:
                self._changed()
            return v1.DemandReply(accepted=True)
        model = self.catalog.model_of(request.model)
        if model is None:
            return v1.DemandReply(accepted=False, reason=f"no such model {request.model!r}")
        self.demand[model] = time.monotonic()
        log.info("demand", model=model, router_id=request.router_id, held=request.held)
        self._changed()
        return v1.DemandReply(accepted=True)

    def declared(self) -> list[DeclaredInfo]:
        """Every model of the catalog, for the snapshot, replicas or not."""
        out = []
        for name in self.catalog.models():
            profiles = self.catalog.of_model(name)
            served = tuple(dict.fromkeys(n for p in profiles for n in p.served_model_names))
            adapters = tuple(a.name for a in self.catalog.adapters_of(name))
            out.append(
                DeclaredInfo(name, served, any(p.min_replicas == 0 for p in profiles), adapters)
            )
        return out

    def on_disconnect(self, session: Session) -> None:
        self.inventory.disconnect(session.node_id, session.session_id)
        self.keeper.node_changed(session.node_id)
        self._changed()

    def on_command_result(
        self, node_id: str, command_id: str, ok: bool, error: str, *, answered: bool
    ) -> None:
        if self.lora.on_result(command_id, ok, error):
            self._changed()
            return
        command = self._sent.pop(command_id, None)
        kind = type(command).__name__.lower() if command is not None else "unknown"
        self.metrics.commands.labels(kind, "ok" if ok else "error").inc()
        if ok:
            return
        log.warning("command failed", node_id=node_id, command_id=command_id, error=error)
        # An agent's refusal of a start comes with a FAILED status; only commands that
        # went unanswered are sent again.
        if command is not None and not answered:
            unsend(self.state, command)
            self._changed()

    # --- the loop -------------------------------------------------------------------

    def _changed(self) -> None:
        self._dirty = True
        self._wake.set()

    async def run(self) -> None:
        # Commands a previous run (a lead since lost) held are not this one's to send.
        self._outbox.clear()
        while True:
            # Read each time: a reload (SIGHUP) may change it.
            interval = self.settings_interval
            try:
                await asyncio.wait_for(self._wake.wait(), interval)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                self.reconcile_now()
            except Exception:
                log.exception("reconcile pass failed")
            if self._outbox:
                await self.send_stored()
            # Let a burst of events (a reconnect storm) pile up into one pass.
            await asyncio.sleep(min(0.05, interval))

    @property
    def settings_interval(self) -> float:
        return float(self.config.control.interval)

    def reconcile_now(self, *, force: bool = False) -> None:
        started = time.perf_counter()
        now = time.monotonic()
        self.ticks += 1
        c = self.config.control
        for node in self.inventory.refresh(now, c.unreachable_after, c.lost_after):
            log.info("node state", node_id=node.node_id, state=node.state.value)
            self._dirty = True
        if not self.publisher.primed.is_set() and now >= self.state.started_at + c.startup_grace:
            # Agents have had their grace to report what runs: publish from now on.
            self.publisher.update(self.endpoints(), self.declared())
            self.publisher.primed.set()
        fresh = 3 * max(float(c.load_interval), float(c.heartbeat_interval))
        # After the startup grace only: what runs is known (adopted) before it is counted.
        grace_over = now >= self.state.started_at + c.startup_grace
        wanted = (
            self.autoscaler.wanted(
                self.catalog, self.state.replicas, self._figures, self.demand, now, fresh
            )
            if grace_over
            else self._wanted
        )
        if wanted != self._wanted:
            self._wanted = wanted
            self._dirty = True
        if self.agents.may_dispatch() and self.publisher.primed.is_set():
            self.lora.step(
                self.catalog,
                self.publisher.endpoints,
                self._adapters_held,
                self.agents.send,
                now,
                expire=2 * float(c.command_timeout),
                prefix=f"{self._prefix}-lora",
            )
        # Same input, no deadline due: the pass would send nothing. On a large fleet
        # a pass costs enough to delay heartbeats, so it is not run for nothing.
        wall = time.time()
        for op in self.ops.nodes.values():
            if op.drain_deadline and wall >= op.drain_deadline not in self._deadlines_passed:
                self._deadlines_passed.add(op.drain_deadline)  # a drain's deadline passed
                self._dirty = True
        if not (force or self._dirty or now >= self._next_at or now >= self._resync_at):
            return
        self._dirty = False
        if now >= self._resync_at:
            self._resync_at = now + RESYNC
        decision = reconcile(
            self.catalog,
            self.inventory.nodes,
            self.state,
            now,
            self.settings,
            wanted=self._wanted,
            ops=operations.directives(self.ops, self._on_nodes(), wall),
        )
        self.state = decision.state
        settled = operations.settle(self.ops, self.state.replicas)
        if settled is not self.ops:
            self.set_ops(settled)
        self.rollouts = decision.rollouts
        self._next_at = decision.next_at
        # With a store, commands go out once the records they follow from are stored
        # (send_stored): a control plane killed at any moment comes back knowing every
        # replica it started and every drain it began. What is published needs no
        # wait: until a Drain goes out, whatever was published before still serves.
        if self.keeper.enabled:
            self._outbox.extend(decision.commands)
        else:
            for command in decision.commands:
                self._dispatch(command)
        self.publisher.update(self.endpoints(), self.declared())
        self.inventory.prune(
            {p.shard_id for r in self.state.replicas.values() for p in r.shards}, now
        )
        self.stage_state()
        self.metrics.reconciles.inc()
        self.metrics.reconcile_seconds.observe(time.perf_counter() - started)

    async def send_stored(self) -> None:
        """Send the held commands once the state store holds the pass they came from."""
        if not await self.keeper.durable(WRITE_AHEAD):
            log.warning(
                "state not stored in time; sending the commands anyway",
                commands=len(self._outbox),
                within_s=WRITE_AHEAD,
            )
        commands, self._outbox = self._outbox, []
        for command in commands:
            self._dispatch(command)

    def _dispatch(self, command: Command) -> None:
        command_id = f"{self._prefix}-{next(self._ids)}"
        if tracing.enabled() and isinstance(command, Start):
            with traces.sending_start(command, command_id):
                self._send(command, command_id)
        else:
            self._send(command, command_id)

    def _send(self, command: Command, command_id: str) -> None:
        msg = traces.stamp_start(self._message(command, command_id))
        if not self.agents.send(command.node_id, command_id, msg):
            unsend(self.state, command)
            self._dirty = True
            return
        self._sent[command_id] = command
        log.info(
            "command sent",
            kind=type(command).__name__,
            node_id=command.node_id,
            shard_id=command.shard_id,
            command_id=command_id,
        )

    def _message(self, command: Command, command_id: str) -> v1.ControlMessage:
        if isinstance(command, Stop):
            return v1.ControlMessage(
                stop_shard=v1.StopShard(
                    command_id=command_id,
                    shard_id=command.shard_id,
                    grace=dt.timedelta(seconds=command.grace),
                )
            )
        if isinstance(command, Drain):
            return v1.ControlMessage(
                drain_shard=v1.DrainShard(
                    command_id=command_id,
                    shard_id=command.shard_id,
                    deadline=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=command.within),
                )
            )
        p = command.profile
        return v1.ControlMessage(
            start_shard=v1.StartShard(
                command_id=command_id,
                shard_id=command.shard_id,
                replica_id=command.replica_id,
                model=p.model,
                profile=p.name,
                engine=ENGINES[p.engine],
                model_ref=p.model_ref,
                engine_args=list(p.engine_args),
                env=dict(p.env),
                gpu_indices=list(command.gpu_indices),
                port=command.port,
                served_model_names=list(p.served_model_names),
                multi_node=v1.MultiNode(
                    rank=command.rank, size=command.size, leader_address=command.leader_address
                ),
                load_timeout=dt.timedelta(seconds=p.load_timeout),
                cpu_threads=p.cpu_threads,
                role=p.role,
                kv_port=command.kv_port,
            )
        )

    def reload(self, loaded: Loaded) -> None:
        """Take a new catalog and timings (SIGHUP); listen addresses need a restart."""
        if (loaded.config.listen, loaded.config.admin_listen, loaded.config.tls) != (
            self.config.listen,
            self.config.admin_listen,
            self.config.tls,
        ):
            log.warning("listen, admin_listen and tls changes take effect after a restart")
        self.config = loaded.config
        self.reload_refused = None
        before, self.config_catalog = self.config_catalog, loaded.catalog
        self.set_ops(operations.remember_previous(self.ops, before, loaded.catalog))
        self.settings = settings_of(loaded.config.control)
        self.agents.load_interval = float(loaded.config.control.load_interval)
        log.info("config reloaded", profiles=len(loaded.catalog.profiles))
        self._changed()

    def model_figures(self) -> list[ModelFigures]:
        """Per model now: wanted, ready, running, waiting, KV use (llmgw_control.history)."""
        now = time.monotonic()
        loads = self.publisher.loads.as_json(now)
        wanted: dict[str, int] = {}
        for p in self.catalog.profiles:
            wanted[p.model] = wanted.get(p.model, 0) + self._wanted.get(p.key, p.replicas)
        replicas = (
            (r.model, replica_state(r, self.inventory.nodes, now), loads.get(r.replica_id))
            for r in self.state.replicas.values()
            if not r.draining
        )
        return model_rows(wanted, replicas, self.requests_in.last)

    def sample_figures(self) -> list[ModelFigures]:
        """The history's sample: the routers' figures since the last one, then the rows."""
        self.requests_in.take()
        return self.model_figures()

    def refuse_reload(self, error: str) -> None:
        """A reload (SIGHUP) whose file was refused: the previous config runs; status and
        the page say so until a reload succeeds."""
        self.reload_refused = {"at": dt.datetime.now(dt.UTC).isoformat(), "error": error}

    # --- what is published and shown ------------------------------------------------

    def endpoints(self) -> list[EndpointInfo]:
        """The ready replicas as routers get them, each at the URL its agent reported."""
        out = []
        problems: dict[str, str] = {}
        now = time.monotonic()
        for r in self.state.replicas.values():
            # A retired replica is published, marked leaving, until its drain begins.
            leaving = publishes_leaving(r.draining, r.leave_at, now)
            if (r.draining and not leaving) or not r.complete or not r.placed:
                continue
            leader = r.shards[0]
            node = self.inventory.nodes.get(leader.node_id)
            # An unreachable node's engine may well be serving: keep it until LOST.
            if node is None or node.state == NodeState.LOST:
                continue
            report = node.shards.get(leader.shard_id)
            if report is None or report.state != v1.ShardState.READY or report.refused:
                continue
            profile = self.catalog.get(r.model, r.profile)
            if profile is None:
                continue
            # The agent owns the address: it knows where its engine listens.
            problem = address_problem(report.endpoint_url, node.peer_host, node.interfaces)
            if problem is not None:
                problems[r.replica_id] = f"{node.node_id}: {problem}"
            if not report.endpoint_url:
                continue
            out.append(
                EndpointInfo(
                    id=r.replica_id,
                    url=report.endpoint_url,
                    served_model_names=profile.served_model_names,
                    model=r.model,
                    profile=r.profile,
                    weight=profile.weight,
                    node_id=node.node_id,
                    labels=tuple(sorted(node.labels.items())),
                    replica_id=r.replica_id,
                    health_path=HEALTH_PATH,
                    shard_id=leader.shard_id,
                    generation=engine_generation(leader.shard_id, report.pid),
                    engine=profile.engine,
                    api_key=report.api_key,
                    routes=report.routes,
                    role=report.role or profile.role,
                    kv_port=report.kv_port or r.kv_port,
                    leaving=leaving,
                    slot=slot_name(r.model, r.profile, r.slot),
                )
            )
        for rid, text in problems.items():
            if self.address_problems.get(rid) != text:
                log.warning("endpoint address unreachable", replica_id=rid, problem=text)
        self.address_problems = problems
        return out

    def _adapters_held(self, endpoint_id: str) -> tuple[frozenset[str], float] | None:
        """The adapters an endpoint's engine holds and its load, from its load reports."""
        f = self.publisher.loads.figures(endpoint_id)
        if f is None:
            return None
        return frozenset(f.adapters), float(f.running + f.waiting)

    def adapters(self) -> dict[str, Any]:
        """LoRA adapters for status: holders, demand, loads and unloads."""
        return self.lora.status(
            self.catalog, self.publisher.endpoints, self._adapters_held, time.monotonic()
        )

    def node_counts(self) -> dict[str, int]:
        counts = {state.value: 0 for state in NodeState}
        for node in self.inventory.nodes.values():
            counts[node.state.value] += 1
        return counts

    def replica_counts(self) -> dict[tuple[str, str, str], int]:
        now = time.monotonic()
        counts: dict[tuple[str, str, str], int] = {}
        for r in self.state.replicas.values():
            key = (r.model, r.profile, replica_state(r, self.inventory.nodes, now))
            counts[key] = counts.get(key, 0) + 1
        return counts

    def _figures(self, endpoint_id: str) -> tuple[Figures, float] | None:
        loads = self.publisher.loads
        f = loads.figures(endpoint_id)
        return None if f is None else (f, loads.age(f, time.monotonic()))

    def fleet(self) -> status_view.Fleet:
        """What status shows, as of now."""
        return status_view.Fleet(
            catalog=self.catalog,
            nodes=self.inventory.nodes,
            state=self.state,
            now=time.monotonic(),
            mgmt_interface=self.settings.mgmt_interface,
            started=self.started,
            ticks=self.ticks,
            publish_version=self.publisher.version,
            streams=len(self.agents.sessions),
            published={e.replica_id: e for e in self.publisher.endpoints},
            address_problems=self.address_problems,
            loads=self.publisher.loads.as_json(time.monotonic()),
            rollouts=self.rollouts,
            scaling=self.autoscaler.reasons,
            reload_refused=self.reload_refused,
            models=[m.as_json() for m in self.model_figures()],
            history=self.history.as_json(),
        )

    def status(self) -> dict[str, Any]:
        out = status_view.status(self.fleet())
        self._show_operations(out)
        if self.catalog.adapters:
            out["lora"] = self.adapters()
        return out

    def _show_operations(self, out: dict[str, Any]) -> None:
        """The operator's overrides, beside what the config says (llmgw_control.ops)."""
        out["operations"] = self.operations()
        held = {n["node_id"]: n for n in out["operations"]["nodes"]}
        for n in out.get("nodes", []):
            op = held.get(n.get("node_id"))
            if op is not None:
                n["cordoned"] = True
                if "drain" in op:
                    n["drain"] = op["drain"]

    def operations(self) -> dict[str, Any]:
        on_nodes = {rid: [p.node_id for p in r.shards] for rid, r in self.state.replicas.items()}
        return operations.progress(self.ops, on_nodes, time.time())

    def summary(self) -> dict[str, Any]:
        return status_view.summary(self.fleet())

    def explain(self, model: str) -> dict[str, Any] | None:
        out = status_view.explain(self.fleet(), model)
        if out is not None:
            # Beside what the config says: the operator's overrides of this model.
            operations.explain_overrides(out, self.ops, self.config_catalog)
        return out
