"""``llmgw-control keys create|list|update|revoke`` and ``llmgw-control usage``.

Each talks to the admin API (:mod:`llmgw_control.keys_admin`); a change carries the
admin credential as the operator's verbs do (:func:`llmgw_control.opscli.connection`:
``--token``/``LLMGW_ADMIN_TOKEN``, ``--token-file``, or an admin certificate). Settings
are checked here first (the same checks the control plane makes), so a typo is named
at once.
"""

from __future__ import annotations

import json
import urllib.parse
from typing import Any

import click
from llmgw_proto.cli import fail
from llmgw_proto.text import visible, visible_data

from llmgw_control import keys as keys_mod
from llmgw_control.opscli import DEFAULT_ADMIN, Client, connection
from llmgw_control.usage import parse_since

__all__ = ["keys", "usage"]


def _call(kw: dict[str, Any], path: str, body: dict[str, Any] | None = None) -> Any:
    """The admin API's JSON answer (POST with a body, else GET), with the admin credential;
    a refusal ends the command with its message (exit 2 for bad input, else 1)."""
    client = Client(
        kw["admin"], kw.get("token", ""), kw.get("token_file"), kw.get("cert"),
        kw.get("key"), kw.get("ca"),
    )  # fmt: skip
    code, data = client.call(path, body)
    if code not in (200, 201):
        message = data.get("error", data) if isinstance(data, dict) else data
        fail(visible(str(message)), code=2 if code == 400 else 1)
    return visible_data(data)


def _settings(given: dict[str, Any]) -> dict[str, Any]:
    """The settings given on the command line, checked (exit 2 naming the flag)."""
    fields = {k: v for k, v in given.items() if k in keys_mod.FLAGS and v is not None}
    try:
        keys_mod.check_fields(fields)
    except keys_mod.KeyInputError as err:
        fail(visible(str(err)))
    return fields


def _limit_options(f: Any) -> Any:
    options = [
        click.option("--models", help="Models the key may use, comma-separated ('': any)."),
        click.option("--rpm", help="Requests per minute, fleet-wide (0: unlimited)."),
        click.option("--tpm", help="Tokens per minute, fleet-wide (0: unlimited)."),
        click.option("--max-concurrent", help="Requests at once, fleet-wide (0: unlimited)."),
        click.option("--priority", help="Priority band, e.g. interactive, default, batch."),
        click.option("--weight", help="Weight within the band for fair share (1 or more)."),
        click.option("--budget-tokens", help="Tokens per period (0: no budget)."),
        click.option("--budget-period", help="day or month (UTC)."),
    ]
    for option in reversed(options):
        f = option(f)
    return connection(f)


@click.group()
def keys() -> None:
    """API keys the routers admit: create, list, update, revoke."""


def _check_name(name: str) -> None:
    try:
        keys_mod.check_name(name)
    except keys_mod.KeyInputError as err:
        fail(visible(str(err)))


@keys.command("create")
@click.argument("name")
@_limit_options
def create(name: str, **kw: Any) -> None:
    """Make key NAME; its secret is printed once, on the last line."""
    _check_name(name)
    fields = _settings(kw)
    got = _call(kw, "/v1/keys", {"name": name, **fields})
    key = got["key"]
    click.echo(f"key {key['name']} created, prefix {key['prefix']}: {_limits(key)}")
    click.echo("the secret below is shown only now; clients send it as 'Authorization: Bearer':")
    click.echo(got["secret"])


@keys.command("update")
@click.argument("name")
@_limit_options
def update(name: str, **kw: Any) -> None:
    """Change key NAME's settings (those given; the rest stay)."""
    _check_name(name)
    fields = _settings(kw)
    if not fields:
        fail("nothing to change: give at least one setting (see --help)")
    got = _call(kw, "/v1/keys/" + urllib.parse.quote(name, safe=""), fields)
    key = got["key"]
    click.echo(f"key {key['name']} updated: {_limits(key)}")


@keys.command("revoke")
@click.argument("name")
@connection
def revoke(name: str, **kw: Any) -> None:
    """Revoke key NAME: every router refuses it within seconds."""
    _check_name(name)
    _call(kw, "/v1/keys/" + urllib.parse.quote(name, safe="") + "/revoke", {})
    click.echo(f"key {name} revoked")


@keys.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON.")
@connection
def list_keys(as_json: bool, **kw: Any) -> None:
    """Every key: prefix, limits, usage this period, last use."""
    got = _call(kw, "/v1/keys")
    if as_json:
        click.echo(json.dumps(got, indent=2))
        return
    rows = [
        [
            k["name"] + (" (revoked)" if k["revoked"] else ""),
            k["prefix"],
            _limits(k),
            _used(k),
            k["last_used"] or "never",
        ]
        for k in got["keys"]
    ]
    if not rows:
        click.echo("no keys (llmgw-control keys create NAME)")
        return
    click.echo(_table(rows, ["NAME", "PREFIX", "LIMITS", "USED THIS PERIOD", "LAST USED"]))


@click.command()
@click.option("--key", "key_name", help="Only this key.")
@click.option("--since", default="24h", show_default=True, help="e.g. 30m, 2h, 7d, 1d12h.")
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON.")
@click.option(
    "--admin",
    envvar="LLMGW_ADMIN",
    default=DEFAULT_ADMIN,
    show_default=True,
    help="The control plane's admin API (URL or host:port; env LLMGW_ADMIN).",
)
def usage(key_name: str | None, since: str, as_json: bool, admin: str) -> None:
    """Requests, tokens, errors, refusals and held time per key, counted by the hour."""
    try:
        seconds = parse_since(since)
    except ValueError as err:
        fail(visible(str(err)))
    query = {"since": str(seconds)}
    if key_name is not None:
        _check_name(key_name)
        query["key"] = key_name
    got = _call({"admin": admin}, "/v1/usage?" + urllib.parse.urlencode(query))
    if as_json:
        click.echo(json.dumps(got, indent=2))
        return
    rows = [
        [
            k["name"],
            str(k["requests"]),
            str(k["prompt_tokens"]),
            str(k["completion_tokens"]),
            str(k["errors"]),
            str(k["refused"]),
            f"{k['held_seconds']:.1f}s",
        ]
        for k in got["keys"]
    ]
    header = ["KEY", "REQUESTS", "PROMPT", "COMPLETION", "ERRORS", "REFUSED", "HELD"]
    click.echo(f"since {got['since']} (by the hour)")
    click.echo(_table(rows, header) if rows else "no keys")


def _limits(k: dict[str, Any]) -> str:
    parts = []
    for field, label in (("rpm", "rpm"), ("tpm", "tpm"), ("max_concurrent", "concurrent")):
        if k[field]:
            parts.append(f"{label} {k[field]}")
    if k["budget_tokens"]:
        parts.append(f"budget {k['budget_tokens']}/{k['budget_period']}")
    if k["models"]:
        parts.append("models " + ",".join(k["models"]))
    parts.append(f"priority {k['priority']}" + (f" x{k['weight']}" if k["weight"] != 1 else ""))
    return ", ".join(parts)


def _used(k: dict[str, Any]) -> str:
    u = k["usage"]
    text = f"{u['requests']} req, {u['prompt_tokens'] + u['completion_tokens']} tok"
    if k["budget_tokens"]:
        text += f" ({k['budget_used']} of {k['budget_tokens']})"
    return text + ("" if k["budget_period"] else " (24h)")


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    )
