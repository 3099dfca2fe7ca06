"""The admin API's key and usage routes (an :class:`~llmgw_control.admin.AdminServer` handler).

- ``GET /v1/keys``: every key with its limits, usage this period and last use;
- ``POST /v1/keys`` ``{"name": ..., settings}``: a new key; the answer holds its
  secret, the only time it is shown (201);
- ``POST /v1/keys/NAME`` (or ``PATCH``) ``{settings}``: change a key's settings;
- ``POST /v1/keys/NAME/revoke``: revoke a key (routers refuse it at once);
- ``GET /v1/usage?since=SECONDS[&key=NAME]``: each key's counts since then.

Changes need the admin credential (:mod:`llmgw_control.auth`, checked by the admin
server). A change is answered once the store holds it. Bad input is a 400 naming the flag;
an unknown key a 404; a name taken or a revoked key a 409; a standby answers 503.
"""

from __future__ import annotations

import math
import urllib.parse
from typing import Any

import msgspec

from llmgw_control.admin import AdminServer, Answer, StatusSource, json_answer
from llmgw_control.controller import Controller
from llmgw_control.keys import KeyInputError
from llmgw_control.leading import Leading
from llmgw_control.tenants import KeyConflict, Tenants

__all__ = ["KeysApi", "WithKeys", "serve_on", "tenants_for"]

_PREFIX = "/v1/keys"


class KeysApi:
    def __init__(self, tenants: Tenants) -> None:
        self.tenants = tenants

    async def __call__(self, method: str, target: str, body: bytes) -> Answer | None:
        split = urllib.parse.urlsplit(target)
        path = split.path
        if path == "/v1/usage":
            if method != "GET":
                return _error(405, f"{method} is not supported on /v1/usage: use GET")
            return self._usage(urllib.parse.parse_qs(split.query))
        if path != _PREFIX and not path.startswith(_PREFIX + "/"):
            return None
        if not self.tenants.leading():
            return _error(503, "this control plane stands by: ask the leader")
        try:
            return await self._keys(method, path, body)
        except KeyInputError as err:
            return _error(400, str(err))
        except KeyConflict as err:
            return _error(err.status, str(err))

    async def _keys(self, method: str, path: str, body: bytes) -> Answer:
        t = self.tenants
        rest = urllib.parse.unquote(path.removeprefix(_PREFIX).lstrip("/"))
        if not rest:
            if method == "GET":
                return json_answer(200, {"keys": t.listing()})
            if method != "POST":
                return _error(405, f"{method} is not supported on {_PREFIX}: use GET or POST")
            fields = _fields(body)
            name = fields.pop("name", None)
            record, secret = t.create(name, fields)
            if not await t.stored():
                return _error(503, f"key {record.name!r} not stored in time; see keys list")
            return json_answer(201, {"key": record.limits(), "secret": secret})
        name, _, action = rest.partition("/")
        if method in ("PATCH", "POST") and not action:
            record = t.update(name, _fields(body))
        elif method == "POST" and action == "revoke":
            record = t.revoke(name)
        else:
            return _error(
                405, f"{method} {path}: use POST {_PREFIX}/NAME or POST {_PREFIX}/NAME/revoke"
            )
        if not await t.stored():
            return _error(503, f"change to key {name!r} not stored in time; see keys list")
        return json_answer(200, {"key": record.limits()})

    def _usage(self, query: dict[str, list[str]]) -> Answer:
        since_text = (query.get("since") or ["86400"])[-1]
        try:
            since = float(since_text)
        except ValueError:
            since = -1.0
        if not math.isfinite(since) or since <= 0:
            return _error(400, f"since: expected seconds (more than 0), got {since_text!r}")
        keys = query.get("key")
        key = keys[-1] if keys else None
        if key is not None and key not in self.tenants.keys:
            return _error(404, f"no key named {key!r} (see keys list)")
        return json_answer(200, self.tenants.usage(since, key))


def _fields(body: bytes) -> dict[str, Any]:
    try:
        data = msgspec.json.decode(body or b"{}")
    except msgspec.DecodeError as err:
        raise KeyInputError(f"the request body is not JSON: {err}") from None
    if not isinstance(data, dict):
        raise KeyInputError("the request body must be a JSON object of key settings")
    return data


def _error(status: int, message: str) -> Answer:
    return json_answer(status, {"error": message})


class WithKeys:
    """A status source whose status JSON has a ``keys`` section (the status page's)."""

    def __init__(self, source: StatusSource, tenants: Tenants) -> None:
        self.source = source
        self.tenants = tenants

    def status(self) -> dict[str, Any]:
        out = self.source.status()
        out["keys"] = self.tenants.status()
        return out

    def summary(self) -> dict[str, Any]:
        return self.source.summary()

    def explain(self, model: str) -> dict[str, Any] | None:
        return self.source.explain(model)


def tenants_for(controller: Controller, leading: Leading) -> Tenants:
    """The keys of ``serve``: read back and forgotten with the rest of the state, writing
    through the controller's keeper, taking only what a router certificate sends."""
    tenants = Tenants(
        controller.metrics.registry,
        keeper=lambda: controller.keeper,
        leading=lambda: controller.agents.dispatching,
        check_router=controller.publisher._check_router,
    )
    leading.on_restored.append(tenants.restore)
    leading.on_forgotten.append(tenants.forget)
    return tenants


def serve_on(admin: AdminServer, tenants: Tenants) -> None:
    """The admin API's key and usage routes, and the status JSON's ``keys`` section."""
    admin.handlers.append(KeysApi(tenants))
    admin.source = WithKeys(admin.source, tenants)
