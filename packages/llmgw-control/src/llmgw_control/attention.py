"""What needs a person's attention, from the status JSON: pure, no I/O.

One list serves `llmgw-control status` (printed last, and its exit status: 3 when the
list is not empty), `--watch` (the line under its timestamp) and the status page's
banner. Each item is ``{"kind", "subject", "text"}``: kinds are ``node`` (unreachable
or lost), ``replica`` (unplaced, failed, in backoff, unreachable), ``rollout``
(stopped), ``config`` (a refused reload) and ``endpoint`` (published at an address
routers cannot reach).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

__all__ = ["clip", "local_time", "needs_attention", "summary_line", "watch_header"]

# Replica states that need a look (a starting or draining one is on its way).
_BAD_REPLICA = {
    "unplaced": "cannot be placed",
    "failed": "failed",
    "backoff": "failed, restarting with backoff",
    "unreachable": "on a node that does not answer",
}


def clip(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, cut at a word's end with an ellipsis."""
    text = " ".join(text.split())
    if len(text) <= width:
        return text
    cut = text[: max(width - 1, 1)]
    space = cut.rfind(" ")
    # Back to the last word's end, unless the cut already is one (or that loses half).
    if text[len(cut)] != " " and space > width // 2:
        cut = cut[:space]
    return cut.rstrip(" ,;:(") + "…"


def needs_attention(status: Mapping[str, Any]) -> list[dict[str, str]]:
    """Everything in ``status`` (the /v1/status JSON) a person should look at."""
    out: list[dict[str, str]] = []
    refused = status.get("config_reload_refused")
    if refused:
        out.append(
            {
                "kind": "config",
                "subject": "config",
                "text": f"config reload refused, the previous config runs: {refused['error']}",
            }
        )
    for n in status.get("nodes", []):
        if n.get("state") in ("UNREACHABLE", "LOST"):
            out.append(
                {
                    "kind": "node",
                    "subject": str(n["node_id"]),
                    "text": f"node {n['node_id']} is {str(n['state']).lower()}",
                }
            )
    for r in status.get("replicas", []):
        what = _BAD_REPLICA.get(str(r.get("state")))
        if what is None:
            continue
        # Unplaced: the placer's reason; failed: the last failure; unreachable: the node.
        why = (
            r.get("reason") or r.get("explanation") or ""
            if r.get("state") == "unplaced"
            else ""
            if r.get("state") == "unreachable"
            else r.get("last_error") or ""
        )
        text = f"{r['model']}/{r['profile']} replica {r['replica_id']} {what}"
        out.append(
            {
                "kind": "replica",
                "subject": str(r["replica_id"]),
                "text": text + (f": {why}" if why else ""),
            }
        )
    for x in status.get("rollouts", []):
        if x.get("state") == "stopped":
            out.append(
                {
                    "kind": "rollout",
                    "subject": f"{x['model']}/{x['profile']}",
                    "text": f"rollout of {x['model']}/{x['profile']} stopped: "
                    f"{x.get('reason') or 'see explain'}",
                }
            )
    for w in status.get("warnings", []):
        out.append(
            {
                "kind": "endpoint",
                "subject": str(w["replica_id"]),
                "text": f"{w['replica_id']}: {w['warning']}",
            }
        )
    return out


def summary_line(items: list[dict[str, str]]) -> str:
    """One line: "all well", or how many of each kind need attention."""
    if not items:
        return "nothing needs attention"
    counts: dict[str, int] = {}
    for item in items:
        counts[item["kind"]] = counts.get(item["kind"], 0) + 1
    words = {
        "config": "refused reload",
        "node": "node",
        "replica": "replica",
        "rollout": "stopped rollout",
        "endpoint": "unreachable endpoint",
    }
    parts = [f"{n} {words.get(k, k)}{'s' if n > 1 else ''}" for k, n in sorted(counts.items())]
    return "needs attention: " + ", ".join(parts)


def local_time(iso: str, *, tz: dt.tzinfo | None = None) -> str:
    """An ISO time from the control plane as the reader's local time; as given if unreadable."""
    try:
        when = dt.datetime.fromisoformat(iso)
    except (TypeError, ValueError):
        return str(iso)
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.astimezone(tz).strftime("%Y-%m-%d %H:%M:%S %Z").strip()


def watch_header(
    items: list[dict[str, str]], interval: float, *, now: dt.datetime | None = None
) -> str:
    """`status --watch`'s first line: when this view was taken, and the attention line."""
    when = (now or dt.datetime.now().astimezone()).strftime("%Y-%m-%d %H:%M:%S %Z").strip()
    return f"{when}  (every {interval:g}s, Ctrl-C to stop)  {summary_line(items)}"
