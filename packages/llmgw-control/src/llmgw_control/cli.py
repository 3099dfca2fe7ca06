"""`llmgw-control` command line: serve, status, explain."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import click
import structlog
from llmgw_proto.cli import fail, load_config_or_exit, log_options
from llmgw_proto.config import ConfigError
from llmgw_proto.tls import CertReloader, server_context

from llmgw_control import __version__
from llmgw_control.admin import AdminServer
from llmgw_control.config import (
    ControlConfig,
    Loaded,
    check,
    load_control_config,
    split_hostport,
    tls_problem,
)
from llmgw_control.controller import Controller, keep_heap, watch_loop_lag
from llmgw_control.stateful import Stateful
from llmgw_control.store import StoreError
from llmgw_control.tls_gate import GatedServer

log = structlog.get_logger("llmgw_control")

DEFAULT_ADMIN = "http://127.0.0.1:9091"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="llmgw-control")
def main() -> None:
    """llmgw-control: decides what runs where, and keeps it so."""


def _load(path: Path) -> Loaded:
    config = load_config_or_exit(path, ControlConfig)
    try:
        return Loaded(config, check(config, str(path)))
    except ConfigError as err:
        fail(str(err))


@main.command()
@click.option(
    "--config",
    "config_path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="control.yaml (or .toml).",
)
@click.option("--insecure", is_flag=True, help="Serve plaintext gRPC (development only).")
@log_options
def serve(config_path: Path, insecure: bool) -> None:
    """Run the control plane. SIGHUP reloads the config's catalog and timings."""
    loaded = _load(config_path)
    problem = tls_problem(loaded.config, insecure, str(config_path))
    if problem is not None:
        fail(str(problem))
    try:
        asyncio.run(
            _serve(loaded, config_path, loaded.config.tls.with_insecure_flag(insecure).insecure)
        )
    except StoreError as err:
        # Never a silent fresh start: a store that cannot be read stops the start.
        fail(f"state store: {err}", code=2)
    except OSError as err:
        fail(f"cannot serve: {err}", code=1)


async def _serve(loaded: Loaded, config_path: Path, insecure: bool) -> None:
    controller = Controller(loaded)
    stateful = Stateful(controller, loaded.config, config_path)
    try:
        await stateful.open()
    except BaseException:
        await stateful.store.close()
        raise
    config = loaded.config
    ssl = None
    reloader: CertReloader | None = None
    if insecure:
        log.warning("serving plaintext gRPC (--insecure): agents and routers are not authenticated")
    else:
        files = (Path(config.tls.cert), Path(config.tls.key), Path(config.tls.ca))
        ssl = server_context(*files)
        # Rotated certificate files are picked up for new connections; open streams stay.
        reloader = CertReloader(ssl, *files)

    def refused(peer: str, why: str) -> None:
        log.warning("connection refused by TLS", peer=peer, why=why)
        controller.metrics.refusals.labels("tls", why.split(":")[0][:60]).inc()

    server = GatedServer(
        stateful.services([controller.agents, controller.publisher]),
        ssl_context=ssl,
        on_refused=refused,
    )
    host, port = split_hostport(config.listen)
    await server.start_gated(host, port)
    admin = AdminServer(controller, controller.metrics.registry, insecure=ssl is None)
    admin_host, admin_port = split_hostport(config.admin_listen)
    try:
        await admin.start(admin_host, admin_port)
    except OSError:
        server.close()
        raise

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: _reload(controller, config_path))
    stateful.start()
    housekeeping = [
        asyncio.create_task(keep_heap()),
        asyncio.create_task(watch_loop_lag(controller.metrics)),
    ]
    if reloader is not None:
        housekeeping.append(asyncio.create_task(reloader.run()))
    log.info(
        "llmgw-control serving",
        listen=config.listen,
        admin=config.admin_listen,
        profiles=len(loaded.catalog.profiles),
        version=__version__,
    )
    await stop.wait()
    log.info("llmgw-control stopping; engines keep running")
    for task in housekeeping:
        task.cancel()
    server.close()
    await admin.close()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(server.wait_closed(), 5.0)
    await stateful.stop()


def _reload(controller: Controller, path: Path) -> None:
    try:
        loaded = load_control_config(path)
    except ConfigError as err:
        # A bad edit must not take down what runs: keep the catalog we have.
        log.error("config reload refused; keeping the previous config", error=str(err))
        return
    controller.reload(loaded)


def _get(admin: str, path: str) -> tuple[int, Any]:
    url = admin.rstrip("/") + path
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - an admin URL
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        body = err.read()
        with contextlib.suppress(ValueError):
            return int(err.code), json.loads(body)
        return int(err.code), {"error": body.decode(errors="replace")}
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        fail(f"cannot reach the admin API at {url}: {reason}", code=1)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    return "\n".join(lines)


admin_option = click.option(
    "--admin",
    default=DEFAULT_ADMIN,
    show_default=True,
    help="Base URL of the control plane's admin API.",
)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON status.")
@admin_option
def status(as_json: bool, admin: str) -> None:
    """Nodes, replicas and unplaceable replicas, as tables."""
    code, data = _get(admin, "/v1/status")
    if code != 200:
        fail(f"admin API answered {code}: {data.get('error', data)}", code=1)
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    nodes = [
        [
            n["node_id"],
            n["state"],
            f"{sum(g['in_use'] for g in n['gpus'])}/{len(n['gpus'])}",
            n["address"] or "-",
            n["last_heartbeat"] or "-",
            ",".join(f"{k}={v}" for k, v in sorted(n["labels"].items())) or "-",
        ]
        for n in data["nodes"]
    ]
    click.echo("NODES")
    click.echo(_table(nodes, ["NODE", "STATE", "GPUS", "ADDRESS", "LAST HEARTBEAT", "LABELS"]))
    replicas = [
        [
            r["replica_id"],
            r["model"],
            r["profile"],
            r["state"] + (" (adopted)" if r["adopted"] else ""),
            ",".join(r["nodes"]) or "-",
            r["endpoint"] or "-",
            str(r["failures"]),
        ]
        for r in data["replicas"]
    ]
    click.echo("\nREPLICAS")
    click.echo(
        _table(replicas, ["REPLICA", "MODEL", "PROFILE", "STATE", "NODES", "ENDPOINT", "FAILURES"])
    )
    if data["unplaceable"]:
        click.echo("\nUNPLACEABLE")
        for u in data["unplaceable"]:
            click.echo(f"{u['replica_id']}: {u['explanation']}")


@main.command()
@click.argument("model")
@admin_option
def explain(model: str, admin: str) -> None:
    """Why each replica of MODEL is where it is, or why it is nowhere."""
    code, data = _get(admin, "/v1/explain/" + urllib.parse.quote(model, safe=""))
    if code == 404:
        fail(data.get("error", f"unknown model {model!r}"), code=1)
    if code != 200:
        fail(f"admin API answered {code}: {data.get('error', data)}", code=1)
    for p in data["profiles"]:
        have = len(p["replicas"])
        click.echo(f"{model} / {p['profile']}: {p['wanted']} wanted, {have} known")
        if not p["replicas"]:
            click.echo("  (none yet: the control plane waits for agents after a start)")
        for r in p["replicas"]:
            where = ",".join(r["nodes"]) or "nowhere"
            click.echo(f"  {r['replica_id']}  {r['state']}  on {where}")
            if r["explanation"]:
                click.echo(f"    why: {r['explanation']}")
            if r["last_error"]:
                click.echo(f"    last error: {r['last_error']}")
            if r["state"] == "backoff":
                click.echo(f"    retry in {r['retry_in']}s (failures: {r['failures']})")
    sys.stdout.flush()


@main.group()
def ca() -> None:
    """The certificate authority for the agent and publish streams (mutual TLS)."""


ca_dir_option = click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Directory holding ca.crt and ca.key (and issued certificates).",
)


@ca.command("init")
@ca_dir_option
@click.option("--days", type=click.IntRange(min=1), default=3650, show_default=True)
def ca_init(directory: Path, days: int) -> None:
    """Make a new CA in DIR (its private key readable by its owner only)."""
    from llmgw_control.ca import CaError, init_ca

    try:
        made = init_ca(directory, days=days)
    except CaError as err:
        fail(str(err))
    click.echo(f"CA certificate: {made.cert}\nCA key (keep it secret): {made.key}")


@ca.command("issue")
@ca_dir_option
@click.option("--node", "node", metavar="NAME", help="A node's client certificate (its node id).")
@click.option("--router", "router", metavar="NAME", help="A router's client certificate.")
@click.option(
    "--server",
    "server",
    metavar="HOST[,HOST...]",
    help="The control plane's server certificate for these DNS names or IP addresses.",
)
@click.option("--days", type=click.IntRange(min=1), default=365, show_default=True)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where to write the certificate and key (default: DIR).",
)
def ca_issue(
    directory: Path,
    node: str | None,
    router: str | None,
    server: str | None,
    days: int,
    out: Path | None,
) -> None:
    """Issue one certificate: exactly one of --node, --router or --server."""
    from llmgw_control.ca import CaError, issue

    chosen = [
        (role, value)
        for role, value in (("node", node), ("router", router), ("server", server))
        if value
    ]
    if len(chosen) != 1:
        fail("give exactly one of --node NAME, --router NAME or --server HOST[,HOST...]")
    role, value = chosen[0]
    hosts = [h.strip() for h in value.split(",") if h.strip()] if role == "server" else []
    name = hosts[0] if hosts else value
    try:
        made = issue(directory, role, name, hosts=hosts or None, days=days, out=out)
    except CaError as err:
        fail(str(err))
    click.echo(f"{role} certificate: {made.cert}\nkey: {made.key}")
