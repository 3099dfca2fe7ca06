"""The agent process: inventory, supervisor and control stream, wired together."""

from __future__ import annotations

import asyncio
import contextlib
import signal

import structlog
from llmgw_proto import tracing, v1
from llmgw_proto.tls import CertReloader, client_context

from llmgw_agent import __version__
from llmgw_agent.config import AgentConfig
from llmgw_agent.inventory import GpuSource, Nvml, collect_inventory, open_gpus
from llmgw_agent.kv_events import KvEventsRelay
from llmgw_agent.load import LoadReporter
from llmgw_agent.logs import LogSubscriptions
from llmgw_agent.lora import AdapterCommands
from llmgw_agent.output import OutputFollower
from llmgw_agent.stream import ControlLink, Outbox
from llmgw_agent.supervisor import Supervisor

__all__ = ["Agent", "run_agent"]

log = structlog.get_logger(__name__)


class Agent:
    """One node's agent. ``run`` until ``stop`` is set; engines outlive it by default."""

    def __init__(self, config: AgentConfig, *, nvml: Nvml | None = None) -> None:
        self.config = config
        self.gpus: GpuSource = open_gpus(config, nvml)
        self.outbox = Outbox()
        self.supervisor = Supervisor(
            config,
            gpus={g.index: self.gpus.simulated for g in self.gpus.gpus},
            simulated=self.gpus.simulated,
            sink=self.outbox.status,
            gpu_memory=self.gpus.memory,
        )
        tls = config.control.tls
        ssl_context = None
        reloader = None
        if tls.insecure:
            log.warning(
                "plaintext connection to the control plane: no TLS (insecure)",
                address=config.control.address,
            )
        else:
            files = tls.files()
            ssl_context = client_context(*files)
            reloader = CertReloader(ssl_context, *files)
        self.adapters = AdapterCommands(self.supervisor.adapter_target)
        self.link = ControlLink(
            config,
            handler=self.supervisor,
            outbox=self.outbox,
            register=self.register,
            usage=self.gpus.usage,
            ssl_context=ssl_context,
            reloader=reloader,
            adapters=self.adapters,
            logs=LogSubscriptions(self._output_of, self.outbox.put),
        )
        self.kv_events = KvEventsRelay(
            self.supervisor.kv_sources,
            lambda events: self.outbox.put(v1.AgentMessage(cache_events=events)),
            interval=lambda: self.link.load_interval,
            session=lambda: self.link.sessions if self.link.connected.is_set() else 0,
        )
        self.load = LoadReporter(
            self.supervisor.load_sources,
            lambda report: self.outbox.put(v1.AgentMessage(load_report=report)),
            interval=lambda: self.link.load_interval,
            session=lambda: self.link.sessions if self.link.connected.is_set() else 0,
            adapters=self.adapters.adapters,
        )

    def _output_of(self, shard_id: str) -> OutputFollower | None:
        engine = self.supervisor.engines.get(shard_id)
        return engine.output if engine is not None else None

    def register(self) -> v1.Register:
        return v1.Register(
            node_id=self.config.node_name,
            agent_version=__version__,
            inventory=collect_inventory(self.config, self.gpus),
            labels=dict(self.config.labels),
            shards=self.supervisor.running_shards(),
            engines=[e.info() for e in self.supervisor.installed().values()],
        )

    async def run(self, stop: asyncio.Event) -> None:
        adopted = self.supervisor.adopt()
        # Engines no record names hold ports and GPUs: gone before control hands them out.
        await self.supervisor.stop_strays()
        # The engines' versions and flags (vLLM's help takes tens of seconds the first
        # time; it is cached per executable and version) before the first Register.
        installed = await asyncio.to_thread(self.supervisor.installed)
        log.info(
            "engines",
            **{
                k: f"unusable: {e.error}" if e.error else e.version or "version unknown"
                for k, e in installed.items()
            },
        )
        log.info(
            "agent starting",
            node=self.config.node_name,
            gpus=len(self.gpus.gpus),
            simulated=self.gpus.simulated,
            adopted=adopted,
            control=self.config.control_addresses(),
        )
        link = asyncio.create_task(self.link.run(), name="control link")
        load = asyncio.create_task(self.load.run(), name="load reports")
        kv = asyncio.create_task(self.kv_events.run(), name="kv events")
        try:
            await stop.wait()
        finally:
            for task in (load, kv):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            stopping = self.config.stop_engines_on_exit
            log.info("agent stopping", stop_engines=stopping, engines=len(self.supervisor.engines))
            await self.supervisor.close(stop_engines=stopping)
            # Statuses still queued (STOPPED ones among them) reach the control plane first.
            await self.link.close(link, timeout=5.0)
            self.gpus.close()


def _on_hangup() -> None:
    # The control plane and the router re-read their files on SIGHUP; the agent's file
    # (node id, engines, state_dir, control address) is what its engines and its stream
    # stand on, so it is read at start only. SIGHUP's default action would end the
    # agent (exit 129): it is caught and changes nothing.
    log.warning(
        "SIGHUP: the agent reads its config only at start; nothing changed. Restart the "
        "agent to apply a new config: its engines keep running and are re-adopted"
    )


def run_agent(config: AgentConfig) -> int:
    """Run until SIGTERM or SIGINT; the exit status. SIGHUP is logged and changes nothing."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, _on_hangup)
        await Agent(config).run(stop)

    # Spans of shard starts, when `tracing.endpoint` is set; flushed at exit.
    tracing.configure(config.tracing, "llmgw-agent")
    try:
        asyncio.run(main())
    finally:
        tracing.shutdown()
    return 0
