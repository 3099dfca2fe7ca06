"""`llmgw-control` verbs that change the fleet, and `logs` (issue 29).

    llmgw-control node cordon|uncordon NODE
    llmgw-control node drain NODE [--deadline 10m] [--wait]
    llmgw-control scale MODEL[/PROFILE] N | --min A --max B | --reset
    llmgw-control restart REPLICA
    llmgw-control rollout status MODEL [--wait]
    llmgw-control rollout pause|resume|undo MODEL
    llmgw-control logs REPLICA [--shard N] [--tail N] [-f]

Each change goes to ``POST /v1/ops/ACTION`` with the admin credential: a token
(``--token``/``LLMGW_ADMIN_TOKEN`` or ``--token-file``/``LLMGW_ADMIN_TOKEN_FILE``) or an
admin client certificate (``--cert``/``--key``/``--ca``, ``LLMGW_ADMIN_CERT`` ...).
"""

from __future__ import annotations

import contextlib
import json
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from llmgw_proto.cli import fail
from llmgw_proto.config import parse_duration
from llmgw_proto.text import visible, visible_data

__all__ = ["register", "render_operations", "rollout_verdict"]

DEFAULT_ADMIN = "http://127.0.0.1:9091"
F = TypeVar("F", bound=Callable[..., Any])


def _base(admin: str) -> str:
    """A base URL from ``http(s)://host:port`` or a bare ``host:port``."""
    admin = admin.strip()
    if "://" not in admin:
        admin = "http://" + admin
    return admin.rstrip("/")


def connection(f: F) -> F:
    """The admin API's address and credentials, from flags or the environment."""
    options = [
        click.option(
            "--admin",
            envvar="LLMGW_ADMIN",
            default=DEFAULT_ADMIN,
            show_default=True,
            help="The control plane's admin API (URL or host:port; env LLMGW_ADMIN).",
        ),
        click.option(
            "--token",
            envvar="LLMGW_ADMIN_TOKEN",
            default="",
            show_default=False,
            help="The admin token (env LLMGW_ADMIN_TOKEN).",
        ),
        click.option(
            "--token-file",
            envvar="LLMGW_ADMIN_TOKEN_FILE",
            type=click.Path(dir_okay=False, path_type=Path),
            default=None,
            help="A file holding the admin token, e.g. <state_dir>/admin.token "
            "(env LLMGW_ADMIN_TOKEN_FILE).",
        ),
        click.option(
            "--cert",
            envvar="LLMGW_ADMIN_CERT",
            type=click.Path(dir_okay=False, path_type=Path),
            default=None,
            help="An admin client certificate (ca issue --admin NAME; env LLMGW_ADMIN_CERT).",
        ),
        click.option(
            "--key",
            envvar="LLMGW_ADMIN_KEY",
            type=click.Path(dir_okay=False, path_type=Path),
            default=None,
            help="Its key (env LLMGW_ADMIN_KEY).",
        ),
        click.option(
            "--ca",
            envvar="LLMGW_ADMIN_CA",
            type=click.Path(dir_okay=False, path_type=Path),
            default=None,
            help="The CA that signed the control plane's certificate (env LLMGW_ADMIN_CA).",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


class Client:
    def __init__(
        self,
        admin: str,
        token: str,
        token_file: Path | None,
        cert: Path | None,
        key: Path | None,
        ca: Path | None,
    ) -> None:
        self.base = _base(admin)
        self.token = token.strip()
        if not self.token and token_file is not None:
            try:
                self.token = token_file.read_text(encoding="utf-8").strip()
            except OSError as err:
                fail(visible(f"--token-file {token_file}: {err.strerror or err}"), code=2)
        self.context: ssl.SSLContext | None = None
        if self.base.startswith("https://"):
            try:
                self.context = ssl.create_default_context(cafile=str(ca) if ca else None)
                if cert is not None:
                    self.context.load_cert_chain(str(cert), str(key) if key else None)
            except (OSError, ssl.SSLError) as err:
                fail(visible(f"admin TLS files: {err}"), code=2)

    def open(self, path: str, body: dict[str, Any] | None = None, timeout: float = 30.0) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data)  # noqa: S310
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        return urllib.request.urlopen(request, timeout=timeout, context=self.context)  # noqa: S310

    def call(self, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        try:
            with self.open(path, body) as resp:
                return int(resp.status), json.loads(resp.read())
        except urllib.error.HTTPError as err:
            raw = err.read()
            with contextlib.suppress(ValueError):
                return int(err.code), json.loads(raw)
            return int(err.code), {"error": raw.decode(errors="replace")}
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            fail(visible(f"cannot reach the admin API at {self.base}: {reason}"), code=1)

    def change(self, action: str, body: dict[str, Any]) -> dict[str, Any]:
        code, data = self.call(f"/v1/ops/{action}", body)
        if code != 200:
            fail(visible(f"{action} refused ({code}): {data.get('error', data)}"), code=1)
        return dict(data)


def _client(**kw: Any) -> Client:
    return Client(
        kw["admin"], kw["token"], kw["token_file"], kw["cert"], kw["key"], kw["ca"]
    )  # fmt: skip


def _say(data: dict[str, Any]) -> None:
    click.echo(visible(f"{data.get('message', 'done')} (by {data.get('by', '?')})"))


# --- node -----------------------------------------------------------------------------


@click.group()
def node() -> None:
    """Take a node out of placement (cordon), or empty it (drain)."""


@node.command("cordon")
@click.argument("node_id")
@connection
def node_cordon(node_id: str, **kw: Any) -> None:
    """No new replicas on NODE; what runs there stays."""
    _say(_client(**kw).change("cordon", {"target": node_id}))


@node.command("uncordon")
@click.argument("node_id")
@connection
def node_uncordon(node_id: str, **kw: Any) -> None:
    """NODE takes new replicas again (a drain in progress is cancelled)."""
    _say(_client(**kw).change("uncordon", {"target": node_id}))


@node.command("drain")
@click.argument("node_id")
@click.option(
    "--deadline",
    default="10m",
    show_default=True,
    help="When its replicas are stopped even if nothing stands in for them yet.",
)
@click.option("--wait", is_flag=True, help="Wait until the node runs no replica.")
@connection
def node_drain(node_id: str, deadline: str, wait: bool, **kw: Any) -> None:
    """Replace NODE's replicas elsewhere (new first, then drained), and keep it cordoned."""
    try:
        seconds = parse_duration(deadline)
    except ValueError as err:
        fail(visible(f"--deadline {deadline!r}: {err}"), code=2)
    client = _client(**kw)
    _say(client.change("drain", {"target": node_id, "deadline": seconds}))
    while wait:
        _, data = client.call("/v1/ops")
        row = next((n for n in data.get("nodes", []) if n["node_id"] == node_id), None)
        drain = (row or {}).get("drain")
        if drain is None:
            fail(visible(f"node {node_id}: the drain was cancelled"), code=1)
        click.echo(
            visible(f"{node_id}: {drain['state']}, {drain['replicas_left']} replica(s) left")
        )
        if drain["state"] == "drained":
            return
        time.sleep(2.0)


# --- scale, restart -------------------------------------------------------------------


@click.command()
@click.argument("target", metavar="MODEL[/PROFILE]")
@click.argument("replicas", type=click.IntRange(min=0), required=False)
@click.option("--min", "low", type=click.IntRange(min=0), help="Autoscaled: the new floor.")
@click.option("--max", "high", type=click.IntRange(min=1), help="Autoscaled: the new ceiling.")
@click.option("--reset", is_flag=True, help="Back to the config's count or bounds.")
@connection
def scale(
    target: str,
    replicas: int | None,
    low: int | None,
    high: int | None,
    reset: bool,
    **kw: Any,
) -> None:
    """Run N replicas of MODEL[/PROFILE], whatever the config says, until --reset."""
    body: dict[str, Any] = {"target": target, "reset": reset}
    for name, value in (("replicas", replicas), ("min", low), ("max", high)):
        if value is not None:
            body[name] = value
    _say(_client(**kw).change("scale", body))


@click.command()
@click.argument("replica_id")
@connection
def restart(replica_id: str, **kw: Any) -> None:
    """Replace REPLICA: a new one starts first, then it is drained (never fewer ready)."""
    _say(_client(**kw).change("restart", {"target": replica_id}))


# --- rollout --------------------------------------------------------------------------


@click.group()
def rollout() -> None:
    """Follow, pause, resume or undo the rollout of a model's changed profile."""


def rollout_verdict(data: dict[str, Any]) -> tuple[str, list[str]]:
    """From ``/v1/explain/MODEL``: "complete", "progressing", "paused" or "stopped", and a
    line per profile. Pure."""
    data = visible_data(data)
    verdicts = []
    lines = []
    for p in data.get("profiles", []):
        ready = sum(1 for r in p.get("replicas", []) if r.get("state") == "ready")
        ro = p.get("rollout")
        if ro:
            state = str(ro["state"])
            verdicts.append(
                state if state in ("stopped", "paused") else "progressing"
            )  # fmt: skip
            line = (
                f"{p['profile']}: rollout to {ro['revision']} {state}, {ro['updated_ready']} of "
                f"{ro['wanted']} updated and ready, {ro['old']} old left"
            )
            if ro.get("reason"):
                line += f": {ro['reason']}"
        elif ready >= p["wanted"]:
            verdicts.append("complete")
            line = f"{p['profile']}: complete, {ready} of {p['wanted']} ready"
        else:
            verdicts.append("progressing")
            line = f"{p['profile']}: {ready} of {p['wanted']} ready"
        lines.append(line)
    for worst in ("stopped", "paused", "progressing"):
        if worst in verdicts:
            return worst, lines
    return "complete", lines


@rollout.command("status")
@click.argument("model")
@click.option("--wait", is_flag=True, help="Wait until complete; exit 1 if it stops.")
@click.option("--timeout", default="30m", show_default=True, help="How long --wait waits.")
@connection
def rollout_status(model: str, wait: bool, timeout: str, **kw: Any) -> None:
    """Where MODEL's rollout stands. Exit 0 complete (or in progress without --wait),
    1 stopped (a new replica failed) or paused, 2 --timeout passed."""
    try:
        until = time.monotonic() + parse_duration(timeout)
    except ValueError as err:
        fail(visible(f"--timeout {timeout!r}: {err}"), code=2)
    client = _client(**kw)
    shown: list[str] = []
    while True:
        code, data = client.call("/v1/explain/" + urllib.parse.quote(model, safe=""))
        if code != 200:
            fail(visible(f"admin API answered {code}: {data.get('error', data)}"), code=1)
        verdict, lines = rollout_verdict(data)
        if lines != shown:
            click.echo("\n".join(lines))
            shown = lines
        if verdict == "stopped":
            fail(f"rollout of {visible(model)} stopped", code=1)
        if verdict == "paused" and wait:
            fail(f"rollout of {visible(model)} is paused (rollout resume MODEL)", code=1)
        if verdict == "complete" or not wait:
            click.echo(f"rollout of {visible(model)}: {verdict}")
            return
        if time.monotonic() >= until:
            fail(f"rollout of {visible(model)} not complete within {timeout}", code=2)
        time.sleep(1.0)


def _rollout_verb(action: str, doc: str) -> None:
    @rollout.command(action, help=doc)
    @click.argument("model")
    @connection
    def verb(model: str, **kw: Any) -> None:
        _say(_client(**kw).change(action, {"target": model}))


_rollout_verb("pause", "Start and drain nothing more for MODEL's rollout until resumed.")
_rollout_verb("resume", "Let MODEL's paused rollout go on.")
_rollout_verb(
    "undo",
    "Roll MODEL back to the revision it ran before the config last changed it "
    "(until the config changes it again).",
)


# --- logs -----------------------------------------------------------------------------


@click.command()
@click.argument("replica_id")
@click.option("--shard", type=click.IntRange(min=0), default=0, show_default=True,
              help="The shard's rank (multi-node replicas).")  # fmt: skip
@click.option("--tail", type=click.IntRange(min=0, max=10_000), default=100, show_default=True,
              help="Lines of what the engine wrote before.")  # fmt: skip
@click.option("--follow", "-f", is_flag=True, help="Go on printing what it writes (Ctrl-C).")
@connection
def logs(replica_id: str, shard: int, tail: int, follow: bool, **kw: Any) -> None:
    """The output of REPLICA's engine, from its agent, without a shell on the node."""
    client = _client(**kw)
    query = urllib.parse.urlencode({"shard": shard, "tail": tail, "follow": int(follow)})
    path = f"/v1/logs/{urllib.parse.quote(replica_id, safe='')}?{query}"
    try:
        with client.open(path, timeout=3600.0 if follow else 60.0) as resp:
            for raw in resp:
                line = raw.decode(errors="replace").rstrip("\n")
                if line.startswith("#error "):
                    fail(visible(line.removeprefix("#error ")), code=1)
                click.echo(visible(line))
                sys.stdout.flush()
    except urllib.error.HTTPError as err:
        body = err.read()
        message = body.decode(errors="replace")
        with contextlib.suppress(ValueError, AttributeError):
            message = json.loads(body).get("error", message)
        fail(visible(f"logs ({err.code}): {message}"), code=1)
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        fail(visible(f"cannot reach the admin API at {client.base}: {reason}"), code=1)
    except KeyboardInterrupt:
        return


def render_operations(data: dict[str, Any]) -> list[str]:
    """The overrides in force as a table for `status` (none: nothing). Pure; ``data`` is
    the status JSON, already through visible_data."""
    ops = data.get("operations") or {}
    rows: list[list[str]] = []
    for n in ops.get("nodes", []):
        drain = n.get("drain")
        what = "cordoned"
        if drain:
            what = (
                f"drain {drain['state']}: {drain['replicas_left']} replica(s) left, "
                f"deadline in {drain['deadline_in']:g}s"
            )
        rows.append([f"node {n['node_id']}", what, n.get("by") or "-"])
    for x in ops.get("scales", []):
        if x.get("replicas") is not None:
            what = f"{x['replicas']} replicas"
        else:
            what = f"autoscaled {x['min']}-{x['max']}"
        rows.append([f"scale {x['model']}/{x['profile']}", what, x.get("by") or "-"])
    for x in ops.get("restarts", []):
        rows.append([f"restart {x['replica_id']}", "replacing", x.get("by") or "-"])
    for x in ops.get("rollouts", []):
        parts = (["paused"] if x.get("paused") else []) + [
            f"undone ({', '.join(x['undone'])})" for _ in [0] if x.get("undone")
        ]
        rows.append([f"rollout {x['model']}", ", ".join(parts) or "-", x.get("by") or "-"])
    if not rows:
        return []
    widths = [max(len(r[i]) for r in [["OVERRIDE", "WHAT", "BY"], *rows]) for i in range(3)]
    return [
        "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in [["OVERRIDE", "WHAT", "BY"], *rows]
        )
    ]


def register(main: click.Group) -> None:
    for command in (node, scale, restart, rollout, logs):
        main.add_command(command)
