"""`llmgw-control` command line: serve, status, explain."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import click
import structlog
from llmgw_proto import tracing
from llmgw_proto.cli import fail, load_config_or_exit, log_options
from llmgw_proto.config import ConfigError
from llmgw_proto.grpc_limits import log_too_large
from llmgw_proto.ports import first_taken
from llmgw_proto.text import visible, visible_data
from llmgw_proto.tls import CertReloader, server_context

from llmgw_control import __version__, keys_admin, keys_cli, operate, opscli
from llmgw_control import check as config_check
from llmgw_control.admin import AdminServer
from llmgw_control.attention import clip, local_time, watch_header
from llmgw_control.auth import TokenError
from llmgw_control.config import (
    ControlConfig,
    Loaded,
    check,
    load_control_config,
    split_hostport,
    tls_problem,
)
from llmgw_control.controller import Controller, keep_heap, watch_loop_lag
from llmgw_control.engine_report import PATH as ENGINE_FLAGS_PATH
from llmgw_control.engine_report import EngineFlagsApi
from llmgw_control.history import run_sampler
from llmgw_control.leading import Leading
from llmgw_control.lora import render_adapters
from llmgw_control.prefixes import PrefixShare
from llmgw_control.store import StoreError
from llmgw_control.tls_gate import GatedServer

log = structlog.get_logger("llmgw_control")

DEFAULT_ADMIN = "http://127.0.0.1:9091"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="llmgw-control")
def main() -> None:
    """llmgw-control: decides what runs where, and keeps it so."""


main.add_command(keys_cli.keys)
main.add_command(keys_cli.usage)


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
    # A port in use: the setting, the address and its holder, before anything starts.
    taken = first_taken(
        {"listen": loaded.config.listen, "admin_listen": loaded.config.admin_listen}
    )
    if taken is not None:
        fail(f"{config_path}: {taken}")
    # Spans of placements and starts, when `tracing.endpoint` is set; flushed at exit.
    tracing.configure(loaded.config.tracing, "llmgw-control")
    try:
        asyncio.run(
            _serve(loaded, config_path, loaded.config.tls.with_insecure_flag(insecure).insecure)
        )
    except StoreError as err:
        # Never a silent fresh start: a store that cannot be read stops the start.
        fail(f"state store: {err}", code=2)
    except TokenError as err:
        fail(f"admin API: {err}", code=2)
    except OSError as err:
        fail(f"cannot serve: {err}", code=1)
    finally:
        tracing.shutdown()


async def _serve(loaded: Loaded, config_path: Path, insecure: bool) -> None:
    controller = Controller(loaded)
    leading = Leading(controller, loaded.config, config_path)
    tenants = keys_admin.tenants_for(controller, leading)
    try:
        await leading.open()
    except BaseException:
        await leading.store.close()
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

    logged = log_too_large(log, "gRPC message refused: too large")

    def too_large(method: str, peer: str, who: str, length: int, limit: int) -> None:
        logged(method, peer, who, length, limit)
        name = method.rsplit("/", 1)[-1]
        stream = {"Connect": "agent"}.get(name, name.lower())
        controller.metrics.refusals.labels(stream, "too large").inc()

    server = GatedServer(
        leading.services(
            [
                controller.agents,
                controller.publisher,
                tenants,
                controller.requests_in,
                # The prefixes routers share (cache_aware.shared_homes), checked as Watch is.
                PrefixShare(controller.publisher._check_router),
            ]
        ),
        ssl_context=ssl,
        on_refused=refused,
        max_message=config.max_message_bytes,
        on_too_large=too_large,
    )
    host, port = split_hostport(config.listen)
    await server.start_gated(host, port)
    admin = AdminServer(controller, controller.metrics.registry, insecure=ssl is None)
    keys_admin.serve_on(admin, tenants)
    # The flags each node's engines accept, for `check --admin`.
    admin.handlers.append(EngineFlagsApi(lambda: controller.inventory.nodes))
    admin_host, admin_port = split_hostport(config.admin_listen)
    try:
        # The operator's verbs and engine logs, behind the admin credential (issue 29).
        admin_tls = operate.install(admin, controller, config, config_path)
        await admin.start(admin_host, admin_port, tls=admin_tls)
    except (OSError, TokenError):
        server.close()
        raise

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: _reload(controller, config_path))
    leading.start()
    housekeeping = [
        asyncio.create_task(keep_heap()),
        asyncio.create_task(watch_loop_lag(controller.metrics)),
        asyncio.create_task(run_sampler(controller.history, controller.sample_figures)),
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
    await leading.stop()


def _reload(controller: Controller, path: Path) -> None:
    try:
        loaded = load_control_config(path)
    except ConfigError as err:
        # A bad edit must not take down what runs: keep the catalog we have.
        log.error("config reload refused; keeping the previous config", error=str(err))
        controller.refuse_reload(str(err))
        return
    controller.reload(loaded)


def _get(admin: str, path: str) -> tuple[int, Any]:
    # A URL, or a bare host:port (http:// assumed), as the operator verbs take it.
    url = opscli._base(admin) + path
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
        fail(visible(f"cannot reach the admin API at {url}: {reason}"), code=1)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    return "\n".join(lines)


admin_option = click.option(
    "--admin",
    envvar="LLMGW_ADMIN",
    default=DEFAULT_ADMIN,
    show_default=True,
    help="The control plane's admin API (URL or host:port; env LLMGW_ADMIN).",
)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON status.")
@click.option("--watch", "-w", is_flag=True, help="Refresh until interrupted (Ctrl-C).")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.2),
    default=2.0,
    show_default=True,
    help="Seconds between refreshes with --watch.",
)
@admin_option
def status(as_json: bool, watch: bool, interval: float, admin: str) -> None:
    """Nodes, replicas, rollouts and what cannot be placed, as tables.

    Exits 3 when something needs attention (a node unreachable or lost, a replica
    unplaced, failed or unreachable, a stopped rollout, a refused config reload), 1
    when the admin API cannot be reached, 0 otherwise.
    """
    while True:
        code, data = _get(admin, "/v1/status")
        if code != 200:
            fail(visible(f"admin API answered {code}: {data.get('error', data)}"), code=1)
        # json.dumps writes control characters as \u escapes; the tables use visible().
        text = json.dumps(data, indent=2) if as_json else render_status(data)
        if not watch:
            click.echo(text)
            sys.stdout.flush()
            sys.exit(3 if data.get("attention") else 0)
        # Clear the screen and draw again, like `watch` or `kubectl get -w`, under the
        # time of this view (local time) and whether anything needs attention.
        head = watch_header(data.get("attention") or [], interval)
        click.echo("\x1b[H\x1b[2J" + head + "\n\n" + text, nl=True)
        try:
            time.sleep(interval)
        except KeyboardInterrupt:
            return


def _engines(n: dict[str, Any]) -> str:
    parts = [
        f"{e['kind']} {e['version']}" if not e.get("error") else f"{e['kind']} (unusable)"
        for e in n.get("engines", [])
    ]
    return ", ".join(parts) or "-"


def _load_text(load: dict[str, Any] | None) -> str:
    if not load or not load.get("known"):
        return "-"
    return f"{load['running']} run, {load['waiting']} wait, kv {load['kv_cache_usage']:.0%}"


def _why(r: dict[str, Any]) -> str:
    """A few words for the REASON column; `explain MODEL` gives the rest."""
    if r["state"] == "unplaced":
        return str(r.get("reason") or "cannot be placed")
    if r["state"] == "backoff":
        return clip(f"retry in {r['retry_in']:g}s: {r['last_error']}", 70)
    if r.get("endpoint_warning"):
        return "endpoint unreachable by routers (see warnings)"
    if r["state"] == "draining":
        return str(r["explanation"]).removeprefix("draining: ")
    return ""


def render_status(data: dict[str, Any]) -> str:
    """The tables of `llmgw-control status`, pure: one string from the status JSON.

    Every string in ``data`` (node ids, labels, reasons: much of it from agents) is
    printed through :func:`llmgw_proto.text.visible`: no control character reaches
    the terminal; the only ones in the result are the layout's own newlines.
    """
    data = visible_data(data)
    out = []
    nodes = [
        [
            n["node_id"],
            n["state"],
            f"{n.get('gpus_used', sum(g['in_use'] for g in n['gpus']))}/{len(n['gpus'])}",
            str(n["shards"]),
            n["address"] or "-",
            _engines(n),
            ",".join(f"{k}={v}" for k, v in sorted(n["labels"].items())) or "-",
        ]
        for n in data["nodes"]
    ]
    out.append(
        _table(
            nodes,
            ["NODE", "STATE", "GPUS USED/TOTAL", "SHARDS", "ADDRESS", "ENGINES", "LABELS"],
        )
    )
    replicas = []
    for r in data["replicas"]:
        shards = r["shards"]
        ready = sum(1 for x in shards if x["state"] == "ready")
        replicas.append(
            [
                r["replica_id"],
                f"{r['model']}/{r['profile']}",
                r["state"] + (" (adopted)" if r["adopted"] else ""),
                f"{ready}/{len(shards)}" if shards else "-",
                ",".join(r["nodes"]) or "-",
                r["endpoint"] or "-",
                _load_text(r.get("load")),
                str(r["failures"]),
                _why(r),
            ]
        )
    out.append(
        _table(
            replicas,
            [
                "REPLICA", "MODEL/PROFILE", "STATE", "SHARDS READY/TOTAL", "NODES", "ENDPOINT",
                "LOAD", "FAILURES", "REASON",
            ],
        )
    )  # fmt: skip
    rollouts = data.get("rollouts") or []
    if rollouts:
        rows = [
            [
                f"{x['model']}/{x['profile']}",
                x["state"],
                f"{x['updated_ready']}/{x['wanted']}",
                str(x["old"]),
                x["reason"] or "-",
            ]
            for x in rollouts
        ]
        out.append(_table(rows, ["ROLLOUT", "STATE", "UPDATED READY/WANTED", "OLD LEFT", "REASON"]))
    scaling = data.get("scaling") or []
    if scaling:
        rows = [
            [
                f"{x['model']}/{x['profile']}",
                f"{x['min']}-{x['max']}",
                str(x["wanted"]),
                str(x["ready"]),
                f"{x['metric']} {'-' if x['value'] is None else x['value']}/{x['target']}",
                x["reason"],
            ]
            for x in scaling
        ]
        out.append(
            _table(rows, ["AUTOSCALED", "MIN-MAX", "WANTED", "READY", "METRIC/TARGET", "WHY"])
        )
    out.extend(render_adapters(data, _table))
    out.extend(opscli.render_operations(data))
    for w in data.get("warnings") or []:
        out.append(f"WARNING {w['replica_id']}: {w['warning']}")
    refused = data.get("config_reload_refused")
    if refused:
        out.append(
            f"WARNING config reload refused at {local_time(refused['at'])}, the previous "
            f"config runs: {refused['error']}"
        )
    if data["unplaceable"]:
        out.append("UNPLACEABLE (llmgw-control explain MODEL for the rest)")
        out.extend(f"{u['replica_id']}: {u['explanation']}" for u in data["unplaceable"])
    attention = data.get("attention") or []
    if attention:
        out.append(
            f"NEEDS ATTENTION ({len(attention)})\n"
            + "\n".join(f"- {item['text']}" for item in attention)
        )
    return "\n\n".join(out)


@main.command("check")
@click.option(
    "--config",
    "config_path",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="control.yaml to judge.",
)
@click.option(
    "--admin",
    envvar="LLMGW_ADMIN",
    default=None,
    help="Also judge it against the nodes of this running control plane (URL or host:port).",
)
def check_command(config_path: Path, admin: str | None) -> None:
    """Judge a config without starting anything (llmgw_control.check).

    Exits 0 when nothing is wrong, 1 with a line per problem, 2 when the file itself is
    refused (the error names the file and the field).
    """
    loaded = _load(config_path)
    found = config_check.problems(loaded.catalog.profiles)
    if admin:
        code, data = _get(admin, "/v1/status")
        if code != 200:
            fail(visible(f"admin API answered {code}: {data.get('error', data)}"), code=1)
        found += config_check.against_fleet(loaded.catalog.profiles, data)
        code, data = _get(admin, ENGINE_FLAGS_PATH)
        if code != 200:
            fail(visible(f"admin API answered {code}: {data.get('error', data)}"), code=1)
        found += config_check.against_engine_flags(loaded.catalog.profiles, data)
    for line in found:
        click.echo(visible(f"{config_path}: {line}"))
    if found:
        sys.exit(1)
    click.echo(f"{config_path}: {len(loaded.catalog.profiles)} profile(s), nothing wrong found")


@main.command()
@click.argument("model")
@admin_option
def explain(model: str, admin: str) -> None:
    """Why each replica of MODEL is where it is, or why it is nowhere."""
    code, data = _get(admin, "/v1/explain/" + urllib.parse.quote(model, safe=""))
    if code == 404:
        fail(visible(str(data.get("error", f"unknown model {model!r}"))), code=1)
    if code != 200:
        fail(visible(f"admin API answered {code}: {data.get('error', data)}"), code=1)
    click.echo(render_explain(model, data))
    sys.stdout.flush()


def render_explain(model: str, data: dict[str, Any]) -> str:
    """`llmgw-control explain`'s text, pure; every string printed through visible()."""
    model, data = visible(model), visible_data(data)
    lines = []
    for p in data["profiles"]:
        have = len(p["replicas"])
        lines.append(f"{model} / {p['profile']}: {p['wanted']} wanted, {have} known")
        if p.get("summary"):
            lines.append(f"  {p['summary']}")
        if p.get("scaling"):
            lines.append(f"  autoscaling: {p['scaling']['reason']}")
        lines.extend(f"  override: {note}" for note in p.get("overrides", []))
        if p.get("rollout"):
            ro = p["rollout"]
            lines.append(
                f"  rollout to {ro['revision']}: {ro['state']}, {ro['updated_ready']} of "
                f"{ro['wanted']} updated and ready, {ro['old']} old left"
                + (f": {ro['reason']}" if ro["reason"] else "")
            )
        if not p["replicas"]:
            lines.append("  (none yet: the control plane waits for agents after a start)")
        for r in p["replicas"]:
            if r["nodes"]:
                lines.append(f"  {r['replica_id']}  {r['state']}  on {','.join(r['nodes'])}")
            else:
                lines.append(f"  {r['replica_id']}  {r['state']}: {_why(r) or 'not placed yet'}")
            if r["explanation"]:
                lines.append(f"    why: {r['explanation']}")
            if r.get("endpoint_warning"):
                lines.append(f"    warning: {r['endpoint_warning']}")
            if r["last_error"]:
                lines.append(f"    last error: {r['last_error']}")
            if r["state"] == "backoff":
                lines.append(f"    retry in {r['retry_in']}s (failures: {r['failures']})")
    return "\n".join(lines)


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
    "--admin",
    "admin_name",
    metavar="NAME",
    help="An operator's client certificate: may change the fleet through the admin API.",
)
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
    admin_name: str | None,
    server: str | None,
    days: int,
    out: Path | None,
) -> None:
    """Issue one certificate: exactly one of --node, --router, --admin or --server."""
    from llmgw_control.ca import CaError, issue

    chosen = [
        (role, value)
        for role, value in (
            ("node", node),
            ("router", router),
            ("admin", admin_name),
            ("server", server),
        )
        if value
    ]
    if len(chosen) != 1:
        fail(
            "give exactly one of --node NAME, --router NAME, --admin NAME "
            "or --server HOST[,HOST...]"
        )
    role, value = chosen[0]
    hosts = [h.strip() for h in value.split(",") if h.strip()] if role == "server" else []
    name = hosts[0] if hosts else value
    try:
        made = issue(directory, role, name, hosts=hosts or None, days=days, out=out)
    except CaError as err:
        fail(str(err))
    click.echo(f"{role} certificate: {made.cert}\nkey: {made.key}")


# The operator's verbs and engine logs (issue 29): node, scale, restart, rollout, logs.
opscli.register(main)
