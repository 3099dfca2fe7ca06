"""The operator's verbs over the admin API: ``GET /v1/ops`` and ``POST /v1/ops/ACTION``.

ACTION is one of ``cordon``, ``uncordon``, ``drain``, ``scale``, ``restart``, ``pause``,
``resume``, ``undo``; the body is JSON: ``{"target": ..., "replicas": N, "min": N,
"max": N, "reset": bool, "deadline": seconds}`` (only what the action takes). The
decision is :func:`llmgw_control.ops.apply`; the admin server has already checked the
credential (:mod:`llmgw_control.auth`) and says who made the change. The answer comes
once the override is in the state store, and every change is logged with who made it.
"""

from __future__ import annotations

import ssl
import time
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
from llmgw_proto.tls import server_context

from llmgw_control import ops as operations
from llmgw_control.admin import CHANGED_BY, AdminServer, Answer, json_answer
from llmgw_control.auth import Credentials, load_token, token_path
from llmgw_control.logs import LogRelay

if TYPE_CHECKING:
    from llmgw_control.config import ControlConfig
    from llmgw_control.controller import Controller

__all__ = ["ACTIONS", "Operations", "install"]

log = structlog.get_logger(__name__)

ACTIONS = ("cordon", "uncordon", "drain", "scale", "restart", "pause", "resume", "undo")
# How long an answer waits for the override to be stored.
STORED_WITHIN = 5.0


class _Body(msgspec.Struct, forbid_unknown_fields=True):
    target: str
    replicas: int | None = None
    min: int | None = None
    max: int | None = None
    reset: bool = False
    deadline: float | None = None


class Operations:
    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    async def handle(self, method: str, target: str, body: bytes) -> Answer | None:
        path = urllib.parse.urlsplit(target).path
        if path == "/v1/ops":
            if method != "GET":
                return json_answer(
                    405, {"error": f"{method} /v1/ops: use GET, or POST /v1/ops/ACTION"}
                )
            return json_answer(200, self.controller.operations())
        if not path.startswith("/v1/ops/"):
            return None
        action = path.removeprefix("/v1/ops/")
        if method != "POST":
            return json_answer(405, {"error": f"{method} {path}: use POST"})
        if action not in ACTIONS:
            return json_answer(
                404, {"error": f"no operation {action[:40]!r}: one of {', '.join(ACTIONS)}"}
            )
        try:
            got = msgspec.json.decode(body or b"{}", type=_Body)
        except msgspec.ValidationError as err:
            return json_answer(400, {"error": f"{action}: request body: {err}"})
        except msgspec.DecodeError as err:
            return json_answer(400, {"error": f"{action}: request body is not JSON: {err}"})
        return await self.operate(action, got, CHANGED_BY.get() or "unauthenticated")

    async def operate(self, action: str, got: _Body, who: str) -> Answer:
        c = self.controller
        if not c.agents.dispatching:
            return json_answer(
                503, {"error": "this control plane stands by: send changes to the leader"}
            )
        verb = operations.Verb(
            action,
            got.target,
            replicas=got.replicas,
            min=got.min,
            max=got.max,
            reset=got.reset,
            deadline=got.deadline,
            by=who,
        )
        try:
            new, line = operations.apply(
                c.ops,
                verb,
                c.config_catalog,
                nodes=c.inventory.nodes.keys(),
                replicas={rid: r.key for rid, r in c.state.replicas.items() if not r.draining},
                now=time.time(),
            )
        except operations.OpError as err:
            log.warning("operator change refused", action=action, target=got.target[:200],
                        by=who, why=str(err))  # fmt: skip
            return json_answer(err.status, {"error": str(err)})
        c.set_ops(new)
        stored = await c.keeper.durable(STORED_WITHIN)
        log.info("operator change", action=action, target=got.target, by=who, change=line,
                 stored=stored)  # fmt: skip
        answer: dict[str, Any] = {"ok": True, "message": line, "by": who, "stored": stored}
        return json_answer(200, answer)


def install(
    admin: AdminServer, controller: Controller, config: ControlConfig, config_path: Path | None
) -> ssl.SSLContext | None:
    """Serve the verbs (and engine logs) on ``admin`` behind the admin credential.

    Returns the admin API's TLS context when ``admin_auth.tls`` asks for one. Raises
    :class:`~llmgw_control.auth.TokenError` when the token file is unusable.
    """
    auth = config.admin_auth
    path = token_path(auth, config.state.state_dir, config_path)
    token: str | None
    try:
        token = load_token(path, create=not auth.token_file)
    except OSError as err:
        log.warning("no admin token: admin changes are refused", path=str(path), error=str(err))
        token = None
    else:
        log.info("admin changes need the token in admin_auth.token_file", path=str(path))
    tls: ssl.SSLContext | None = None
    if auth.tls:
        files = config.tls.files()
        tls = server_context(*files, require_client_cert=False)
        tls.set_alpn_protocols(["http/1.1"])
    admin.credentials = Credentials(token=token, certificates=tls is not None)
    ops = Operations(controller)
    admin.handlers.append(ops.handle)
    admin.streamers.append(LogRelay(controller).serve)
    return tls
