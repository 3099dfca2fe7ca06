"""GET /v1/engine-flags: the flags each ready node's engines accept, as their agents
reported them in Register (EngineInfo.value_flags / switch_flags), for
``llmgw-control check --admin`` (llmgw_control.check.against_engine_flags).

Kept off /v1/status, which every page and CLI poll fetches: a node's engines list
400-600 flags each.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

from llmgw_control.admin import Answer, json_answer
from llmgw_control.inventory import Node

__all__ = ["PATH", "EngineFlagsApi", "flags_view"]

PATH = "/v1/engine-flags"


def flags_view(nodes: Mapping[str, Node]) -> dict[str, Any]:
    """Pure: every node's engines with the flags they listed, sorted."""
    return {
        "nodes": [
            {
                "node_id": n.node_id,
                "state": n.state.value,
                "engines": [
                    {
                        "kind": e.kind,
                        "version": e.version,
                        "error": e.error,
                        "flags_listed": e.flags_listed,
                        "value_flags": sorted(e.value_flags),
                        "switch_flags": sorted(e.switch_flags),
                    }
                    for e in n.engines
                ],
            }
            for n in sorted(nodes.values(), key=lambda n: n.node_id)
        ]
    }


class EngineFlagsApi:
    """An :class:`~llmgw_control.admin.AdminServer` handler for :data:`PATH`."""

    def __init__(self, nodes: Callable[[], Mapping[str, Node]]) -> None:
        # Asked on each request: the controller replaces its inventory when it leads.
        self.nodes = nodes

    async def __call__(self, method: str, target: str, body: bytes) -> Answer | None:
        if urllib.parse.urlsplit(target).path != PATH:
            return None
        if method not in ("GET", "HEAD"):
            return json_answer(405, {"error": f"{method} is not supported on {PATH}: use GET"})
        return json_answer(200, flags_view(self.nodes()))
