"""`llmgw-control status` and `explain` print agent-supplied strings escaped (issue 24.6).

A node label such as ``"\\x1b]0;pwned\\x07\\x1b[2J"`` (retitle the terminal, clear the
screen) must reach the reader as text, never as a terminal sequence.
"""

from __future__ import annotations

import asyncio
import json
import unicodedata
from typing import Any

from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st
from llmgw_control.admin import AdminServer
from llmgw_control.cli import main, render_explain, render_status
from llmgw_control.metrics import Metrics
from llmgw_testkit import free_port

ATTACK = "\x1b]0;pwned\x07\x1b[2J"
SHOWN = "\\x1b]0;pwned\\x07\\x1b[2J"


def fleet(text: str) -> dict[str, Any]:
    """A status JSON with ``text`` in every place an agent's string can land."""
    replica = {
        "replica_id": f"m.p.{text}", "model": text, "profile": text, "state": "backoff",
        "adopted": False, "nodes": [text], "endpoint": text, "shards": [{"state": "failed"}],
        "failures": 2, "retry_in": 5, "last_error": text, "explanation": text,
        "reason": text, "endpoint_warning": text, "output_tail": text,
        "load": None,
    }  # fmt: skip
    return {
        "nodes": [
            {
                "node_id": text, "state": "READY", "address": text, "shards": 1,
                "labels": {text: text, "zone": text}, "gpus_used": 0, "gpus": [{"in_use": False}],
                "engines": [
                    {"kind": text, "version": text, "executable": text, "error": ""},
                    {"kind": text, "version": "", "executable": "", "error": text},
                ],
            }
        ],
        "replicas": [replica, {**replica, "state": "unplaced", "replica_id": "m.p.2"}],
        "rollouts": [
            {"model": text, "profile": text, "state": "stopped", "updated_ready": 0,
             "wanted": 1, "old": 1, "reason": text, "revision": text},
        ],
        "scaling": [
            {"model": text, "profile": text, "min": 0, "max": 2, "wanted": 1, "ready": 0,
             "metric": text, "value": None, "target": 1, "reason": text},
        ],
        "warnings": [{"replica_id": text, "warning": text}],
        "unplaceable": [{"replica_id": text, "explanation": text}],
    }  # fmt: skip


def explain_data(text: str) -> dict[str, Any]:
    data = fleet(text)
    return {
        "model": text,
        "profiles": [
            {
                "profile": text, "wanted": 2, "replicas": data["replicas"], "summary": text,
                "scaling": data["scaling"][0], "rollout": data["rollouts"][0],
            }
        ],
    }  # fmt: skip


def controls(text: str) -> set[str]:
    return {ch for ch in text if unicodedata.category(ch) == "Cc" and ch != "\n"}


def test_the_tables_show_the_sequence_escaped() -> None:
    text = render_status(fleet(ATTACK))
    assert "\x1b" not in text
    assert "\x07" not in text
    assert f"{SHOWN}={SHOWN}" in text  # the label, as kubectl would show it
    assert text.count(SHOWN) >= 20
    explained = render_explain(ATTACK, explain_data(ATTACK))
    assert "\x1b" not in explained
    assert "\x07" not in explained
    assert explained.startswith(f"{SHOWN} / {SHOWN}:")


def test_a_newline_in_a_label_does_not_break_the_row() -> None:
    text = render_status(fleet("a\nFAKE-ROW"))
    assert not any(line.startswith("FAKE-ROW") for line in text.splitlines())
    assert "a\\x0aFAKE-ROW" in text


@given(st.text(max_size=40))
def test_no_control_character_but_the_layouts_newlines(text: str) -> None:
    assert controls(render_status(fleet(text))) == set()
    assert controls(render_explain(text, explain_data(text))) == set()


class Source:
    def status(self) -> dict[str, Any]:
        return fleet(ATTACK)

    def summary(self) -> dict[str, Any]:
        return {}

    def explain(self, model: str) -> dict[str, Any] | None:
        return explain_data(ATTACK) if model == "m" else None


async def test_status_and_explain_commands_print_a_hostile_label_escaped() -> None:
    """The real commands against a real admin socket serving a node with that label."""
    admin = AdminServer(Source(), Metrics().registry)
    port = free_port()
    await admin.start("127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    try:
        for args in (["status"], ["explain", "m"], ["status", "--json"]):
            result = await asyncio.to_thread(CliRunner().invoke, main, [*args, "--admin", url])
            assert result.exit_code == 0, result.output
            assert controls(result.output) == set(), args
            assert ("\\u001b" if "--json" in args else SHOWN) in result.output
        as_json = await asyncio.to_thread(
            CliRunner().invoke, main, ["status", "--json", "--admin", url]
        )
        # --json stays exact: decoding it gives the label back byte for byte.
        assert json.loads(as_json.output)["nodes"][0]["labels"]["zone"] == ATTACK
    finally:
        await admin.close()
