"""`llmgw-router` command line."""

from __future__ import annotations

from pathlib import Path

import click
import msgspec
from llmgw_proto.cli import fail, load_config_or_exit, log_options
from llmgw_proto.config import ConfigError
from llmgw_proto.ports import first_taken

from llmgw_router import __version__
from llmgw_router.config import RouterConfig, parse_endpoint_flag, resolve_api_keys, validate
from llmgw_router.endpoints import EndpointSpec

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="llmgw-router")
def main() -> None:
    """llmgw-router: the OpenAI-compatible proxy in front of the engine replicas."""


@main.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="router.yaml (or .toml); without it, defaults plus --endpoint flags.",
)
@click.option("--listen", help="HOST:PORT for the OpenAI API (overrides `listen`).")
@click.option(
    "--admin-listen", help="HOST:PORT for /metrics, /healthz, /readyz (overrides `admin_listen`)."
)
@click.option(
    "--endpoint",
    "endpoint_flags",
    multiple=True,
    metavar="ID=URL=MODEL[,MODEL]",
    help="A static endpoint (profile `static`, weight 1); repeat for more.",
)
@click.option(
    "--insecure", is_flag=True, help="Plaintext gRPC to the control plane (logs a warning)."
)
@click.option(
    "--workers",
    type=click.IntRange(1, 1024),
    help="Router processes sharing the port (overrides `workers`; default: one per core).",
)
@log_options
def serve(
    config_path: Path | None,
    listen: str | None,
    admin_listen: str | None,
    endpoint_flags: tuple[str, ...],
    insecure: bool,
    workers: int | None,
) -> None:
    """Serve the OpenAI API and proxy each request to an engine replica."""
    cfg = load_config_or_exit(config_path, RouterConfig) if config_path else RouterConfig()
    source = str(config_path) if config_path else "command line"
    extra = []
    for flag in endpoint_flags:
        try:
            extra.append(parse_endpoint_flag(flag))
        except ValueError as err:
            fail(f"--endpoint: {err}")
    overrides: dict[str, object] = {}
    if listen:
        overrides["listen"] = listen
    if admin_listen:
        overrides["admin_listen"] = admin_listen
    if extra:
        overrides["endpoints"] = [*cfg.endpoints, *extra]
    if workers is not None:
        overrides["workers"] = workers
    cfg = msgspec.structs.replace(cfg, **overrides)
    if insecure and cfg.control is not None:
        tls = msgspec.structs.replace(cfg.control.tls, insecure=True)
        cfg = msgspec.structs.replace(cfg, control=msgspec.structs.replace(cfg.control, tls=tls))
    try:
        validate(cfg, source)
    except ConfigError as err:
        # A clash that only the flags produced is named as a flag.
        message = str(err)
        if extra and "endpoints[" in message and not config_path:
            message = f"--endpoint: {err.message}"
        elif listen and "$.listen" in message:
            message = f"--listen: {err.message}"
        elif admin_listen and "$.admin_listen" in message:
            message = f"--admin-listen: {err.message}"
        fail(message)
    if cfg.control is not None:
        from llmgw_router.control.watch import control_ssl

        try:
            control_ssl(cfg.control, insecure)
        except ValueError as err:
            fail(f"{source}: {err}")
    try:
        api_keys = resolve_api_keys(cfg, source)
    except ConfigError as err:
        fail(str(err))
    if not cfg.endpoints and cfg.control is None:
        fail(
            f"{source}: no endpoints: give `endpoints:` or `control:` in the config, or --endpoint"
        )
    # A port in use: the setting (or flag), the address and its holder, whatever server
    # and worker mode would follow (uvicorn alone printed its own lines and exit 3).
    taken = first_taken(
        {
            "--listen" if listen else "listen": cfg.listen,
            "--admin-listen" if admin_listen else "admin_listen": cfg.admin_listen,
        }
    )
    if taken is not None:
        fail(f"{source}: {taken}")
    static = tuple(
        EndpointSpec(
            id=e.id,
            url=e.url.rstrip("/"),
            models=tuple(e.models),
            profile=e.profile,
            weight=e.weight,
            health_path=e.health_path,
            cache_tokens=e.cache_tokens,
            role=e.role,
            engine=e.engine,
            kv_port=e.kv_port,
            slot=e.slot,
        )
        for e in cfg.endpoints
    )
    from llmgw_router.workers.supervisor import run_router

    params = click.get_current_context().params
    run_router(
        cfg,
        static,
        insecure=insecure,
        api_keys=api_keys,
        log_level=params.get("log_level", "info"),
        log_format=params.get("log_format", "auto"),
    )
