"""From a StartShard to what would be launched, or why not: one pure step.

``Supervisor.start`` and ``llmgw-agent dry-run`` both call :func:`plan`, so what the
dry run prints is what a StartShard launches. engine_args are read once, against the
installed engine's own flags, and that reading is what validation checks and what the
adapter builds the command line from.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw_proto import v1

from llmgw_agent.adapters import Adapter, Launch, adapter_for, build_launch
from llmgw_agent.config import AgentConfig
from llmgw_agent.disagg import role_problems
from llmgw_agent.engine_flags import ParsedArgs
from llmgw_agent.validation import NodeView, Probes, validate

__all__ = ["Plan", "Refused", "plan"]


@dataclass(frozen=True)
class Plan:
    """A StartShard that may be launched: the engine, its reading of the args, the launch."""

    start: v1.StartShard
    adapter: Adapter
    parsed: ParsedArgs
    launch: Launch
    load_timeout: float


@dataclass(frozen=True)
class Refused:
    problems: list[str]
    # What would have been launched, where it could be built (dry-run prints it).
    launch: Launch | None = None


def plan(
    start: v1.StartShard, config: AgentConfig, node: NodeView, probes: Probes
) -> Plan | Refused:
    """The launch for ``start`` on this node, or every problem with it at once."""
    adapter = adapter_for(start.engine)
    command = config.engine_command(adapter.name) if adapter else []
    installed = node.engines.get(adapter.name) if adapter else None
    spec = installed.spec if installed is not None else None
    parsed = spec.parse(start.engine_args) if spec is not None else None
    problems = validate(start, adapter, parsed, command, node, probes, bind_host=config.bind_host())
    if adapter is not None:
        problems += role_problems(start, adapter.name, parsed)
    launch = None
    if adapter is not None and parsed is not None:
        try:
            launch = build_launch(
                adapter,
                start,
                parsed,
                command,
                bind_host=config.bind_host(),
                endpoint_host=config.endpoint_host(),
                rdma=node.rdma_devices,
            )
        except ValueError as err:  # e.g. a leader address validation already named
            if not problems:
                problems.append(str(err))
    if problems or adapter is None or parsed is None or launch is None:
        return Refused(problems or ["cannot build the engine command"], launch)
    timeout = start.load_timeout.total_seconds() if start.load_timeout else config.load_timeout
    return Plan(start, adapter, parsed, launch, float(timeout))
