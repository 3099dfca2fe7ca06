"""`llmgw-agent` command line: run, inventory, dry-run."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import betterproto2
import click
from llmgw_proto import v1
from llmgw_proto.cli import fail, log_options
from llmgw_proto.config import ConfigError
from llmgw_proto.logs import setup_logging

from llmgw_agent import __version__
from llmgw_agent.adapters import adapter_for
from llmgw_agent.config import AgentConfig, load_agent_config
from llmgw_agent.disagg import rdma_devices
from llmgw_agent.engines import load_installed
from llmgw_agent.inventory import collect_inventory, open_gpus
from llmgw_agent.plan import Refused, plan
from llmgw_agent.records import live_records
from llmgw_agent.validation import NodeView, real_probes

_ENGINE_NAMES = {"vllm": "ENGINE_KIND_VLLM", "sglang": "ENGINE_KIND_SGLANG"}
_ENGINE_NAMES["llamacpp"] = "ENGINE_KIND_LLAMACPP"


def _config_or_exit(path: str | None, *, insecure: bool = False) -> AgentConfig:
    try:
        return load_agent_config(path, insecure=insecure)
    except ConfigError as err:
        fail(str(err))


def _snake(message: betterproto2.Message) -> dict[str, Any]:
    return message.to_dict(casing=betterproto2.Casing.SNAKE, include_default_values=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="llmgw-agent")
def main() -> None:
    """llmgw's node agent: registers this node with the control plane and runs its engines."""


@main.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="agent.yaml")
@click.option("--json", "as_json", is_flag=True, help="Print the Register message as JSON.")
@click.option(
    "--engines",
    "with_engines",
    is_flag=True,
    help="Also ask each engine its version and flags (vLLM's take up to a minute).",
)
def inventory(config_path: str | None, as_json: bool, with_engines: bool) -> None:
    """Print what this node would register: GPUs, host, interfaces, labels, engines."""
    # Log lines go to stderr so `--json` output stays parseable.
    setup_logging("warning" if as_json else "info", "console", stream=sys.stderr)
    config = _config_or_exit(config_path, insecure=True)
    gpus = open_gpus(config)
    try:
        register = v1.Register(
            node_id=config.node_name,
            agent_version=__version__,
            inventory=collect_inventory(config, gpus),
            labels=dict(config.labels),
        )
    finally:
        gpus.close()
    if with_engines:
        installed = load_installed(config, Path(config.state_dir).expanduser())
        register.engines = [e.info() for e in installed.values()]
    if as_json:
        click.echo(json.dumps(_snake(register), indent=2))
        return
    inv = register.inventory
    assert inv is not None
    assert inv.host is not None
    click.echo(f"node        {register.node_id} (agent {register.agent_version})")
    click.echo(
        f"host        {inv.hostname}: {inv.host.cpu_count} CPUs, {_gib(inv.host.memory_total_bytes)}"
    )
    click.echo(f"os          {inv.host.os}, kernel {inv.host.kernel}")
    driver = f"{inv.driver_version or '-'}, CUDA {inv.cuda_version or '-'}"
    click.echo(f"driver      {driver}{' (simulated GPUs)' if inv.simulated else ''}")
    if not inv.gpus:
        click.echo("gpus        none")
    for gpu in inv.gpus:
        peers = f" nvlink→{','.join(gpu.nvlink_peers)}" if gpu.nvlink_peers else ""
        click.echo(
            f"gpu {gpu.index:<7} {gpu.name} {_gib(gpu.memory_total_bytes)} {gpu.uuid} "
            f"{gpu.pci_bus_id}{peers}"
        )
    for iface in inv.interfaces:
        click.echo(f"interface   {iface.name}: {' '.join(iface.addresses) or '-'}")
    for key, value in sorted(register.labels.items()):
        click.echo(f"label       {key}={value}")
    for engine in register.engines:
        state = f"unusable: {engine.error}" if engine.error else engine.version or "?"
        click.echo(f"engine      {engine.kind.name.lower()}: {state} ({engine.executable})")


def _gib(n: int) -> str:
    return f"{n / 1024**3:.1f} GiB"


def read_start(path: str) -> v1.StartShard:
    """A StartShard from JSON (proto JSON names, snake_case or camelCase); exits 2 if bad."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        fail(f"{path}: cannot read: {err.strerror or err}")
    except json.JSONDecodeError as err:
        fail(f"{path}: invalid JSON: line {err.lineno}, column {err.colno}: {err.msg}")
    if not isinstance(data, dict):
        fail(f"{path}: expected a JSON object with StartShard fields")
    engine = data.get("engine")
    if isinstance(engine, str) and engine.lower() in _ENGINE_NAMES:
        data["engine"] = _ENGINE_NAMES[engine.lower()]
    try:
        return v1.StartShard.from_dict(data)
    except (KeyError, ValueError, TypeError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        fail(f"{path}: {message}")


@main.command("dry-run")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="agent.yaml")
@click.option(
    "--start",
    "start_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="A StartShard as JSON.",
)
@click.option("--json", "as_json", is_flag=True, help="Print argv, env and problems as JSON.")
def dry_run(config_path: str | None, start_path: str, as_json: bool) -> None:
    """Print the exact argv and environment a StartShard would launch, and its validation.

    Exits 0 when the shard would be launched, 1 when validation refuses it.
    """
    setup_logging("warning", "console", stream=sys.stderr)
    config = _config_or_exit(config_path, insecure=True)
    start = read_start(start_path)
    gpus = open_gpus(config)
    gpu_memory = gpus.memory()
    gpus.close()
    state_dir = Path(config.state_dir).expanduser()
    # Shards already running on this node hold their GPUs and ports.
    records = live_records(state_dir)
    adapter = adapter_for(start.engine)
    node = NodeView(
        gpus={g.index: gpus.simulated for g in gpus.gpus},
        simulated=gpus.simulated,
        gpus_in_use={i: r.shard_id for r in records for i in r.start.gpu_indices},
        ports_in_use={r.start.port: r.shard_id for r in records},
        engines=load_installed(config, state_dir, (adapter.name,)) if adapter else {},
        gpu_memory=gpu_memory,
        rdma_devices=rdma_devices(),
    )
    decided = plan(start, config, node, real_probes())
    launch = decided.launch
    problems = decided.problems if isinstance(decided, Refused) else []
    if as_json:
        out: dict[str, Any] = {"ok": not problems, "problems": problems}
        if launch is not None:
            out.update(
                argv=launch.argv,
                env=launch.env,
                health_url=launch.health_url,
                metrics_url=launch.metrics_url,
                endpoint_url=launch.endpoint_url,
                headless=launch.headless,
                endpoint_warning=launch.endpoint_warning,
            )
        click.echo(json.dumps(out, indent=2))
    else:
        if launch is not None:
            click.echo("argv: " + " ".join(_quote(a) for a in launch.argv))
            click.echo("env:")
            for key, value in sorted(launch.env.items()):
                click.echo(f"  {key}={value}")
            click.echo(f"health: {launch.health_url}")
            click.echo(f"endpoint: {launch.endpoint_url or '(headless: no HTTP)'}")
            if launch.endpoint_warning:
                click.echo(f"WARNING: {launch.endpoint_warning}")
        if problems:
            click.echo("validation: FAILED")
            for problem in problems:
                click.echo(f"  - {problem}")
        else:
            click.echo("validation: ok")
    sys.exit(1 if problems else 0)


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


@main.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="agent.yaml")
@click.option("--insecure", is_flag=True, help="Plaintext to the control plane (logs a warning).")
@log_options
def run(config_path: str | None, insecure: bool) -> None:
    """Register with the control plane and run the engines it asks for.

    SIGTERM or SIGINT stops the agent; engines keep running (a new agent re-adopts
    them) unless stop_engines_on_exit is set. SIGHUP changes nothing (logged): the
    config is read at start only; restart the agent to apply a new one.
    """
    config = _config_or_exit(config_path, insecure=insecure)
    from llmgw_agent.agent import run_agent

    sys.exit(run_agent(config))
