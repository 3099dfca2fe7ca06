"""Stage 1, admit: may this request be served at all? Judged on its head alone.

The route and method (404, 405), the caller's API key (401), the router draining
(503), the body's size (413); and `/v1/models`, which is answered here, from the
endpoint set, without going further.
"""

from __future__ import annotations

import hmac
import time

import msgspec

from llmgw_router.config import ApiKey
from llmgw_router.errors import ApiError
from llmgw_router.lora import adapter_entries
from llmgw_router.proxy.context import Headers
from llmgw_router.proxy.routes import methods_for
from llmgw_router.state import RouterState, now
from llmgw_router.tenants.gate import Tenancy, lookup_secret

__all__ = ["MODELS_PATH", "PROXIED_PATHS", "Admission", "too_large"]

PROXIED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
MODELS_PATH = "/v1/models"


def too_large(limit: int, declared: int | None) -> ApiError:
    if declared is not None:
        message = f"request body of {declared} bytes is over the limit of {limit} bytes"
    else:
        message = f"request body is over the limit of {limit} bytes"
    return ApiError(413, message, code="request_too_large")


class Admission:
    """Route, key and drain checks; the model list."""

    __slots__ = ("keys", "state", "tenancy")

    def __init__(
        self, state: RouterState, keys: tuple[ApiKey, ...], tenancy: Tenancy | None = None
    ) -> None:
        self.state = state
        # Replaced whole when SIGHUP re-reads the keys file.
        self.keys = keys
        # The control plane's keys (WatchKeys), by prefix, are the tenancy's.
        self.tenancy = tenancy

    def admit(self, method: str, path: str, headers: Headers) -> ApiKey | None:
        """Route and key checks: the caller's key (None: open access), or an ApiError."""
        if path in PROXIED_PATHS:
            if method != "POST":
                raise ApiError(
                    405, f"{method} is not allowed on {path}; use POST", code="method_not_allowed"
                )
        elif path == MODELS_PATH:
            if method != "GET":
                raise ApiError(
                    405, f"{method} is not allowed on {path}; use GET", code="method_not_allowed"
                )
        else:
            methods = methods_for(path)
            if methods is None:
                raise ApiError(404, f"no route {method} {path}", code="not_found")
            if method not in methods:
                raise ApiError(
                    405,
                    f"{method} is not allowed on {path}; use {' or '.join(methods)}",
                    code="method_not_allowed",
                )
        return self.authorize(headers)

    def authorize(self, headers: Headers) -> ApiKey | None:
        """The caller's key; None when the router has no keys (open access)."""
        keys = self.keys
        tenancy = self.tenancy
        by_prefix = tenancy.by_prefix if tenancy is not None else None
        # Open access only while no key was ever configured or sent by the control plane.
        if not keys and not (tenancy is not None and tenancy.closed):
            return None
        header = headers.get(b"authorization") or b""
        scheme, _, token = header.partition(b" ")
        token = token.strip()
        # Every key is compared, in constant time each, so timing says nothing about which.
        found: ApiKey | None = None
        for key in keys:
            if hmac.compare_digest(token, key.secret):
                found = key
        if found is None and by_prefix:
            # A control-plane key: by its prefix, then its hash in constant time.
            found = lookup_secret(by_prefix, token)
        if scheme.lower() != b"bearer" or found is None:
            raise ApiError(
                401,
                "missing or invalid API key: send `Authorization: Bearer <key>`",
                "authentication_error",
                code="invalid_api_key",
            )
        return found

    def check_draining(self) -> None:
        if self.state.draining:
            raise ApiError(
                503,
                "the router is shutting down",
                "service_unavailable_error",
                code="shutting_down",
                headers=[(b"retry-after", b"1"), (b"connection", b"close")],
            )

    def models_body(self, api_key: ApiKey | None = None) -> bytes:
        """Models with a usable endpoint, and declared scale-to-zero models at zero."""
        at = now()
        endpoints = self.state.endpoints
        created = int(time.time())
        names = set(endpoints.models) | {m for m, zero in endpoints.declared.items() if zero}
        data = []
        for model in sorted(names):
            if api_key is not None and not api_key.allows(model):
                continue
            eps = endpoints.for_model(model) or ()
            if any(ep.usable(at) for ep in eps) or (not eps and endpoints.declared.get(model)):
                data.append(
                    {"id": model, "object": "model", "created": created, "owned_by": "llmgw"}
                )
        # LoRA adapters, each with its base model as parent (as vLLM lists them).
        data += adapter_entries(
            endpoints.adapters,
            (lambda name: True) if api_key is None else api_key.allows,
            created,
        )
        return msgspec.json.encode({"object": "list", "data": data})
