"""vLLM's disaggregated prefill protocol (NixlConnector), as the simulator speaks it (issue 32).

A request whose ``kv_transfer_params`` say ``do_remote_decode`` is a prefill for another
engine: it is served as usual (the proxy asks for one token, not streamed) and its answer
carries the ``kv_transfer_params`` a decode engine needs (``do_remote_prefill``, the
remote engine id, block ids, host and port, as vLLM's NixlConnector answers). A request
whose params say ``do_remote_prefill`` is a decode: its prompt counts as in the cache
(no prefill is charged) and the transfer costs ``--sim-kv-transfer-per-token`` seconds per
prompt token instead.

The simulators are separate processes, so a decode engine cannot ask the prefill engine
what it issued: the params carry ``sim_signature``, an HMAC-SHA256 (key: the environment
variable ``LLMGW_SIM_KV_SECRET``, default ``llmgw-sim-kv``, the same for every simulator of
one test) over the engine id, block ids, request id and prompt length. A decode engine
refuses (400) params it cannot verify: forged, altered, or for another prompt length.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

__all__ = ["issue", "verify", "wants_remote_decode", "wants_remote_prefill"]

SECRET_ENV = "LLMGW_SIM_KV_SECRET"  # noqa: S105 (a variable's name, not a secret)
BLOCK = 16


def _secret() -> bytes:
    return os.environ.get(SECRET_ENV, "llmgw-sim-kv").encode()


def wants_remote_decode(params: Any) -> bool:
    return isinstance(params, dict) and params.get("do_remote_decode") is True


def wants_remote_prefill(params: Any) -> bool:
    return isinstance(params, dict) and params.get("do_remote_prefill") is True


def _signed(params: dict[str, Any], prompt_len: int) -> str:
    fields = [
        params.get("remote_engine_id"),
        params.get("remote_block_ids"),
        params.get("remote_request_id"),
        prompt_len,
    ]
    message = json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()
    return hmac.new(_secret(), message, hashlib.sha256).hexdigest()


def issue(engine_id: str, request_id: str, prompt_len: int, host: str, port: int) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill engine answers with."""
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_block_ids": list(range((prompt_len + BLOCK - 1) // BLOCK)),
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
    }
    params["sim_signature"] = _signed(params, prompt_len)
    return params


def verify(params: dict[str, Any], prompt_len: int) -> str | None:
    """Why a decode engine refuses ``params`` (None: a prefill engine issued them)."""
    given = params.get("sim_signature")
    if not isinstance(given, str) or not hmac.compare_digest(given, _signed(params, prompt_len)):
        return (
            "kv_transfer_params were not issued by a prefill engine for this prompt "
            f"(remote_engine_id {params.get('remote_engine_id')!r}): no KV cache to fetch"
        )
    return None
