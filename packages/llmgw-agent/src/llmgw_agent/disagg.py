"""Engines of a disaggregated profile's pools (issue 32): their KV connectors.

A StartShard with a ``role`` ("prefill" or "decode") launches its engine with the
connector that moves the KV cache from prefill to decode engines, spelled as the
installed engine's own flags (captured help in ``engine_help/``):

- vLLM: ``--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'``
  on a prefill engine, ``kv_consumer`` on a decode engine (vLLM 0.32 warns that
  ``kv_both`` with NixlConnector is deprecated and asks for these; the request's
  ``kv_transfer_params`` say which side an engine is for each request), and the NIXL
  side channel other engines reach it on in
  ``VLLM_NIXL_SIDE_CHANNEL_HOST``/``VLLM_NIXL_SIDE_CHANNEL_PORT``: the endpoint host and
  the port placement gave (``kv_port``).
- SGLang: ``--disaggregation-mode prefill|decode``, a prefill engine's bootstrap server
  on ``--disaggregation-bootstrap-port`` (``kv_port``), and unless the profile sets them,
  ``--disaggregation-transfer-backend mooncake`` and ``--disaggregation-ib-device`` from
  the node's RDMA devices (:func:`rdma_devices`, also in the inventory).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from llmgw_proto import v1

from llmgw_agent.engine_flags import ParsedArgs

__all__ = ["ROLES", "rdma_devices", "role_launch", "role_problems", "vllm_connector"]

ROLES = ("prefill", "decode")
# vLLM's kv_role for each role.
VLLM_KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
SYSFS_INFINIBAND = Path("/sys/class/infiniband")


def rdma_devices(root: Path = SYSFS_INFINIBAND) -> tuple[str, ...]:
    """The node's RDMA devices (mlx5_0, ...), sorted; () where it has none."""
    try:
        return tuple(sorted(p.name for p in root.iterdir()))
    except OSError:
        return ()


def vllm_connector(role: str) -> dict[str, str]:
    """A vLLM engine's ``--kv-transfer-config`` for ``role`` (prefill or decode)."""
    return {"kv_connector": "NixlConnector", "kv_role": VLLM_KV_ROLES[role]}


def _flags(engine: str, role: str) -> tuple[str, ...]:
    if engine == "vllm":
        return ("--kv-transfer-config",)
    if engine == "sglang":
        flags = ("--disaggregation-mode", "--disaggregation-transfer-backend")
        return flags + (("--disaggregation-bootstrap-port",) if role == "prefill" else ())
    return ()


def role_problems(start: v1.StartShard, engine: str, parsed: ParsedArgs | None) -> list[str]:
    """What is wrong with ``start``'s role on this engine; [] for none (or no role)."""
    if not start.role:
        return []
    if start.role not in ROLES:
        return [f"role {start.role!r} is not prefill or decode"]
    if engine not in ("vllm", "sglang"):
        return [f"{engine} has no prefill/decode disaggregation (role {start.role})"]
    problems: list[str] = []
    if not start.kv_port:
        problems.append(f"a {start.role} engine needs kv_port (its KV connector's port)")
    if parsed is not None:
        missing = [f for f in _flags(engine, start.role) if not parsed.spec.accepts(f)]
        if missing:
            problems.append(
                f"the installed {engine} {parsed.spec.version} does not accept "
                f"{', '.join(missing)}: it cannot run a {start.role} engine"
            )
    return problems


def role_launch(
    engine: str,
    start: v1.StartShard,
    parsed: ParsedArgs,
    endpoint_host: str,
    rdma: Sequence[str],
) -> tuple[list[str], dict[str, str]]:
    """The arguments and environment ``start``'s role adds to its engine's launch (none for
    a role that is not prefill or decode: :func:`role_problems` names it)."""
    if start.role not in ROLES:
        return [], {}
    if engine == "vllm":
        config = json.dumps(vllm_connector(start.role), separators=(",", ":"))
        env = {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": endpoint_host,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(start.kv_port),
        }
        return ["--kv-transfer-config", config], env
    if engine == "sglang":
        argv = ["--disaggregation-mode", start.role]
        if start.role == "prefill":
            argv += ["--disaggregation-bootstrap-port", str(start.kv_port)]
        if not parsed.has("--disaggregation-transfer-backend"):
            argv += ["--disaggregation-transfer-backend", "mooncake"]
        if rdma and not parsed.has("--disaggregation-ib-device"):
            argv += ["--disaggregation-ib-device", ",".join(rdma)]
        return argv, {}
    return [], {}
