"""Checks a StartShard must pass before anything is launched.

An engine refuses a bad profile only after minutes of loading; these checks
refuse it in milliseconds, each with a reason that names the problem. The rules
are pure: what they need from the machine (PATH, a port, a file) comes through
:class:`Probes`, so tests drive every rule with plain values.
"""

from __future__ import annotations

import contextlib
import operator
import os
import re
import shutil
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from llmgw_proto import v1
from llmgw_proto.addr import parse_hostport

from llmgw_agent.adapters import Adapter
from llmgw_agent.engine_flags import ParsedArgs
from llmgw_agent.engines import InstalledEngine
from llmgw_agent.kv_events import loopback_kv_config
from llmgw_agent.weights import memory_problems

__all__ = [
    "NodeView",
    "Probes",
    "looks_like_path",
    "real_probes",
    "validate",
    "version_problems",
]

# The agent owns these: CUDA_VISIBLE_DEVICES comes from gpu_indices.
_RESERVED_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")


@dataclass(frozen=True)
class NodeView:
    """What validation needs to know of the node and the shards already on it."""

    # GPU index -> whether that GPU is simulated.
    gpus: Mapping[int, bool]
    simulated: bool
    gpus_in_use: Mapping[int, str] = field(default_factory=dict)
    ports_in_use: Mapping[int, str] = field(default_factory=dict)
    # The engines installed, by adapter name: their version, flags, or why they are unusable.
    engines: Mapping[str, InstalledEngine] = field(default_factory=dict)
    # GPU index -> (total, free) bytes, where known.
    gpu_memory: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    # The node's RDMA devices (llmgw_agent.disagg.rdma_devices): a decode/prefill
    # engine's transfer devices.
    rdma_devices: tuple[str, ...] = ()


def _read_text(path: str) -> str | None:
    try:
        return Path(path).expanduser().read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def _file_sizes(path: str) -> dict[str, int]:
    """Name -> size of the files in a folder (or of the one file ``path`` is)."""
    p = Path(path).expanduser()
    try:
        if p.is_file():
            return {p.name: p.stat().st_size}
        return {c.name: c.stat().st_size for c in p.iterdir() if c.is_file()}
    except OSError:
        return {}


@dataclass(frozen=True)
class Probes:
    which: Callable[[str], str | None]
    port_free: Callable[[str, int], bool]
    path_exists: Callable[[str], bool]
    read_text: Callable[[str], str | None] = lambda path: None
    file_sizes: Callable[[str], dict[str, int]] = lambda path: {}


def _port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # Same option the engines' servers use, so a port in TIME_WAIT counts as free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _which(name: str) -> str | None:
    if os.sep in name:
        return name if os.access(name, os.X_OK) and os.path.isfile(name) else None
    return shutil.which(name)


def real_probes() -> Probes:
    return Probes(
        which=_which,
        port_free=_port_free,
        path_exists=lambda p: os.path.exists(os.path.expanduser(p)),
        read_text=_read_text,
        file_sizes=_file_sizes,
    )


def looks_like_path(model_ref: str) -> bool:
    """A local path rather than a hub name like ``Qwen/Qwen2.5-7B-Instruct``."""
    return model_ref.startswith(("/", "./", "../", "~")) or model_ref.endswith(".gguf")


def validate(
    start: v1.StartShard,
    adapter: Adapter | None,
    parsed: ParsedArgs | None,
    command: Sequence[str],
    node: NodeView,
    probes: Probes,
    *,
    bind_host: str,
) -> list[str]:
    """Every problem with ``start``; empty means it may be launched.

    ``parsed`` is engine_args read against the installed engine's flags; None when the
    engine's flags are unknown (``node.engines`` says why).
    """
    problems: list[str] = []
    if not start.shard_id:
        problems.append("shard_id is empty")
    if adapter is None:
        return [*problems, f"unknown engine kind {start.engine!r}"]
    engine = adapter.name
    installed = node.engines.get(engine)
    if parsed is None:
        why = installed.error if installed is not None else "its flags were not read"
        problems.append(f"{engine} cannot be used on this node: {why}")
    if start.engine_version:
        problems += version_problems(
            engine, start.engine_version, installed.version if installed else ""
        )
    if not command or probes.which(command[0]) is None:
        exe = command[0] if command else ""
        problems.append(
            f"engine executable {exe!r} not found on PATH (engines.{engine}.command in agent.yaml)"
        )
    if not start.model_ref:
        problems.append("model_ref is empty")
    elif looks_like_path(start.model_ref) and not probes.path_exists(start.model_ref):
        problems.append(f"model path {start.model_ref!r} does not exist on this node")
    if adapter.max_served_names and len(start.served_model_names) > adapter.max_served_names:
        problems.append(
            f"{engine} serves one model name, got {len(start.served_model_names)}: "
            f"{list(start.served_model_names)}"
        )
    problems += _check_port(start, node, probes, bind_host)
    problems += _check_gpus(start, adapter, node)
    problems += _check_multi_node(start, adapter)
    if parsed is not None:
        problems += _check_args(start, adapter, parsed)
        kv_raw = parsed.first("--kv-events-config")
        if kv_raw is not None and adapter.name in ("vllm", "sglang"):
            problem = loopback_kv_config(kv_raw)[1]
            if problem:
                problems.append(problem)
        if not any(p.startswith("engine_args:") or "parallel" in p for p in problems):
            problems += _check_model(start, adapter, parsed, node, probes)
    for name in _RESERVED_ENV:
        if name in start.env:
            problems.append(f"env sets {name}, which the agent sets from gpu_indices")
    return problems


def _check_port(start: v1.StartShard, node: NodeView, probes: Probes, host: str) -> list[str]:
    if not 0 < start.port < 65536:
        return [f"port {start.port} is not a valid TCP port"]
    owner = node.ports_in_use.get(start.port)
    if owner is not None and owner != start.shard_id:
        return [f"port {start.port} is used by shard {owner}"]
    if not probes.port_free(host, start.port):
        return [f"port {start.port} is not free on {host}"]
    return []


def _check_gpus(start: v1.StartShard, adapter: Adapter, node: NodeView) -> list[str]:
    problems: list[str] = []
    indices = list(start.gpu_indices)
    if adapter.needs_gpus and not indices:
        problems.append(f"{adapter.name} needs at least one GPU, gpu_indices is empty")
    seen: set[int] = set()
    for index in indices:
        if index in seen:
            problems.append(f"GPU {index} is listed twice in gpu_indices")
            continue
        seen.add(index)
        if index not in node.gpus:
            have = sorted(node.gpus)
            problems.append(f"GPU {index} does not exist on this node (GPUs: {have or 'none'})")
        elif node.gpus[index] and not node.simulated:
            problems.append(f"GPU {index} is simulated and this node is not")
        owner = node.gpus_in_use.get(index)
        if owner is not None and owner != start.shard_id:
            problems.append(f"GPU {index} is used by shard {owner}")
    return problems


def _check_multi_node(start: v1.StartShard, adapter: Adapter) -> list[str]:
    multi = start.multi_node
    if multi is None or multi.size <= 1:
        return []
    if not adapter.multi_node:
        return [f"{adapter.name} does not run across nodes (multi_node.size {multi.size})"]
    problems: list[str] = []
    if multi.rank >= multi.size:
        problems.append(f"multi_node.rank {multi.rank} is not below multi_node.size {multi.size}")
    try:
        parse_hostport(multi.leader_address)
    except ValueError as err:
        problems.append(f"multi_node.leader_address: {err}")
    return problems


def _check_args(start: v1.StartShard, adapter: Adapter, parsed: ParsedArgs) -> list[str]:
    problems = [f"engine_args: {e} for {adapter.name}" for e in parsed.errors]
    # Any spelling of a reserved option counts (-tp for --tensor-parallel-size, …).
    reserved = [o for r in adapter.reserved if (o := parsed.spec.option(r)) is not None]
    for key, given in sorted(parsed.given.items()):
        if any(parsed.spec.option(key) is o for o in reserved):
            problems.append(f"engine_args: {given} is set by the agent from the StartShard")
    if start.cpu_threads and parsed.has("--threads"):
        problems.append("engine_args: --threads conflicts with cpu_threads; give one of them")
    if not adapter.tp_flag:
        return problems
    sizes: dict[str, int] = {}
    for flag in (adapter.tp_flag, adapter.pp_flag):
        raw = parsed.first(flag)
        if raw is None:
            continue
        value = -1
        with contextlib.suppress(ValueError):
            value = int(raw)
        if value < 1:
            problems.append(f"engine_args: {flag} {raw!r} is not a whole number >= 1")
        sizes[flag] = value
    if any(v < 1 for v in sizes.values()) or not start.gpu_indices:
        return problems
    tp, pp = adapter.parallel_sizes(start, parsed)
    nodes = max(1, start.multi_node.size) if start.multi_node else 1
    gpus = len(start.gpu_indices) * nodes
    if tp * pp != gpus:
        where = f"{len(start.gpu_indices)} GPUs per node x {nodes} nodes"
        problems.append(
            f"tensor parallel {tp} x pipeline parallel {pp} = {tp * pp}, "
            f"but the shard has {gpus} GPUs ({where})"
        )
    return problems


def _check_model(
    start: v1.StartShard, adapter: Adapter, parsed: ParsedArgs, node: NodeView, probes: Probes
) -> list[str]:
    """What a local model's own files say before minutes of loading would."""
    if not looks_like_path(start.model_ref) or not probes.path_exists(start.model_ref):
        return []
    tp, pp = adapter.parallel_sizes(start, parsed)
    return memory_problems(
        start, adapter, parsed, tp * pp, node.gpu_memory, probes.read_text, probes.file_sizes
    )


_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<|=)?\s*v?b?(\d+(?:\.\d+)*)\s*$")


def _numbers(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version))


def version_problems(engine: str, wanted: str, have: str) -> list[str]:
    """Whether ``have`` satisfies ``wanted`` (">=0.30", ">=0.30,<0.33", "b11434")."""
    clauses = []
    for raw in wanted.split(","):
        match = _CLAUSE.match(raw)
        if not match:
            return [
                f"engine_version {wanted!r}: {raw.strip()!r} is not a version or a comparison "
                "like >=0.30"
            ]
        clauses.append((match.group(1) or "==", _numbers(match.group(2))))
    if not have:
        return [f"engine_version {wanted!r}: this node's {engine} version could not be read"]
    version = _numbers(have)

    def padded(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        width = max(len(a), len(b))  # 0.30 is 0.30.0
        return a + (0,) * (width - len(a)), b + (0,) * (width - len(b))

    tests = {
        ">=": lambda a, b: operator.ge(*padded(a, b)),
        "<=": lambda a, b: operator.le(*padded(a, b)),
        ">": lambda a, b: operator.gt(*padded(a, b)),
        "<": lambda a, b: operator.lt(*padded(a, b)),
        "==": lambda a, b: a[: len(b)] == b,
        "=": lambda a, b: a[: len(b)] == b,
        "!=": lambda a, b: a[: len(b)] != b,
    }
    for op, bound in clauses:
        if not tests[op](version, bound):
            return [f"engine_version {wanted!r}: this node has {engine} {have}"]
    return []
