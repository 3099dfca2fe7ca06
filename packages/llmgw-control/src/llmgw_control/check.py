"""`llmgw-control check --config FILE`: a config judged without starting anything.

What loading already refuses (a located error, exit 2), then what only shows once
engines start, found here first (exit 1, one line per problem, each naming the profile):

- tensor x pipeline (x data) parallel sizes in ``engine_args`` that do not use the
  GPUs a replica is given (``gpus_per_node`` x ``nodes``): vLLM's ``--tensor-parallel-size``
  / ``-tp``, ``--pipeline-parallel-size`` / ``-pp``, ``--data-parallel-size`` / ``-dp``;
  SGLang's ``--tp-size`` / ``--tp``, ``--pp-size``, ``--dp-size`` / ``--dp``. Without
  them the agents choose sizes that fit (tensor inside a node, pipeline across nodes);
- with ``--admin`` (a running control plane): profiles whose engine no ready node
  offers usable (the engines the agents report), or that want more GPUs per node, or
  more nodes, than any are.

- with ``--admin``: flags in ``engine_args`` that a ready node's engine does not accept,
  judged against the flags its help lists (the agents report them in Register:
  ``EngineInfo.value_flags`` / ``switch_flags``; served by GET /v1/engine-flags), once per
  engine version, naming the nodes that run it. Values (arity, choices) are judged by
  the agent that starts the engine (``llmgw-agent dry-run``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from llmgw_control.catalog import ProfileSpec

__all__ = ["against_engine_flags", "against_fleet", "parallel_problem", "problems", "unknown_flags"]

# Spellings of each size, per engine; the first is what messages name.
_SIZES: Mapping[str, Mapping[str, tuple[str, ...]]] = {
    "vllm": {
        "tensor": ("--tensor-parallel-size", "-tp"),
        "pipeline": ("--pipeline-parallel-size", "-pp"),
        "data": ("--data-parallel-size", "-dp"),
    },
    "sglang": {
        "tensor": ("--tp-size", "--tp", "--tensor-parallel-size"),
        "pipeline": ("--pp-size", "--pipeline-parallel-size"),
        "data": ("--dp-size", "--dp", "--data-parallel-size"),
    },
}


def _value(args: Sequence[str], names: tuple[str, ...]) -> tuple[str, str] | None:
    """(spelling, value) of the last of ``names`` in ``args`` (``--x 2`` or ``--x=2``)."""
    found = None
    for i, arg in enumerate(args):
        name, eq, inline = arg.partition("=")
        if name in names:
            if eq:
                found = (name, inline)
            elif i + 1 < len(args):
                found = (name, args[i + 1])
    return found


def parallel_problem(engine: str, engine_args: Sequence[str], gpus: int, nodes: int) -> str:
    """Why the parallel sizes in ``engine_args`` do not fit ``gpus`` x ``nodes``; "" if
    they do, or say nothing."""
    sizes = _SIZES.get(engine)
    if sizes is None or gpus == 0:
        return ""
    given: dict[str, tuple[str, int]] = {}
    for kind, names in sizes.items():
        found = _value(engine_args, names)
        if found is None:
            continue
        name, raw = found
        try:
            value = int(raw)
        except ValueError:
            return f"{name} {raw!r} is not a whole number"
        if value < 1:
            return f"{name} {value} must be at least 1"
        given[kind] = (name, value)
    if not given:
        return ""
    total = gpus * nodes
    tp = given.get("tensor", ("", 0))[1]
    pp = given.get("pipeline", ("", 1))[1]
    dp = given.get("data", ("", 1))[1]
    if not tp:
        # The agents fill tensor parallel in: it must come out whole.
        if total % (pp * dp):
            return (
                f"{_words(given)} do not divide the {total} GPUs a replica gets "
                f"(gpus_per_node {gpus} x nodes {nodes})"
            )
        return ""
    if tp * pp * dp != total:
        product = " x ".join(f"{name} {value}" for name, value in given.values())
        return (
            f"{product} = {tp * pp * dp} GPUs, but a replica gets {total} "
            f"(gpus_per_node {gpus} x nodes {nodes})"
        )
    return ""


def _words(given: Mapping[str, tuple[str, int]]) -> str:
    return " x ".join(f"{name} {value}" for name, value in given.values())


def problems(profiles: Iterable[ProfileSpec]) -> list[str]:
    """What the config's profiles would run into, each naming its profile."""
    out = []
    for p in profiles:
        why = parallel_problem(p.engine, p.engine_args, p.gpus_per_node, p.nodes)
        if why:
            out.append(f"models[{p.model}].profiles.{p.name}.engine_args: {why}")
    return out


def against_fleet(profiles: Iterable[ProfileSpec], status: Mapping[str, Any]) -> list[str]:
    """What no ready node of a running control plane (its /v1/status) could run."""
    ready = [n for n in status.get("nodes", []) if n.get("state") == "READY"]
    if not ready:
        return ["the control plane has no ready node: nothing to check the profiles against"]
    out = []
    for p in profiles:
        where = f"models[{p.model}].profiles.{p.name}"
        offering = [
            n
            for n in ready
            if any(
                str(e.get("kind", "")).lower().endswith(p.engine) and not e.get("error")
                for e in n.get("engines", [])
            )
        ]
        if not offering:
            out.append(f"{where}.engine: no ready node offers a usable {p.engine}")
            continue
        most = max(len(n.get("gpus", [])) for n in offering)
        if p.gpus_per_node > most:
            out.append(
                f"{where}.gpus_per_node: {p.gpus_per_node}, but the nodes with {p.engine} "
                f"have at most {most} GPUs"
            )
        if p.nodes > len(offering):
            out.append(
                f"{where}.nodes: {p.nodes}, but {len(offering)} ready node(s) offer {p.engine}"
            )
    return out


_NUMBER = re.compile(r"-\d+(\.\d+)?")


def _is_flag(engine: str, arg: str, known: frozenset[str]) -> bool:
    if engine == "llamacpp":  # llama.cpp takes values that start with a single '-'
        return arg.partition("=")[0] in known or arg.startswith("--")
    return arg.startswith("-") and arg not in ("-", "--") and not _NUMBER.fullmatch(arg)


def _accepted(engine: str, name: str, value_flags: frozenset[str], known: frozenset[str]) -> bool:
    if name in known:
        return True
    if engine == "vllm":
        if name.startswith("-O") and not name.startswith("--"):
            return "--optimization-level" in known  # -O3 / -O=3
        if name.startswith("--"):
            # vLLM reads --x_y as --x-y, and --json-arg.key as a key of a JSON option.
            head, dot, _ = name.partition(".")
            head = head.replace("_", "-")
            return head in (value_flags if dot else known)
    if engine != "llamacpp" and not name.startswith("--"):
        # argparse reads "-tp2" as "-tp 2".
        return any(name[:cut] in value_flags for cut in range(2, len(name)))
    return False


def unknown_flags(
    engine: str,
    engine_args: Sequence[str],
    value_flags: frozenset[str],
    switch_flags: frozenset[str],
) -> list[str]:
    """Pure: the flags in ``engine_args`` that an engine listing these flags does not
    accept, in order, each once. Values after a flag, and positional words, are skipped."""
    known = value_flags | switch_flags
    out: list[str] = []
    for arg in engine_args:
        if not _is_flag(engine, arg, known):
            continue
        name = arg.partition("=")[0]
        if not _accepted(engine, name, value_flags, known) and name not in out:
            out.append(name)
    return out


def _nodes_words(nodes: Sequence[str]) -> str:
    shown = ", ".join(nodes[:3])
    more = f" and {len(nodes) - 3} more" if len(nodes) > 3 else ""
    return f"node{'s' if len(nodes) > 1 else ''} {shown}{more}"


def against_engine_flags(profiles: Iterable[ProfileSpec], report: Mapping[str, Any]) -> list[str]:
    """Flags in the profiles' engine_args that a ready node's engine does not accept.

    ``report`` is GET /v1/engine-flags: ``{"nodes": [{"node_id", "state", "engines":
    [{"kind", "version", "error", "flags_listed", "value_flags", "switch_flags"}]}]}``.
    Engines that listed no flags (an older agent) are not judged. One line per flag and
    engine version, naming the nodes that run that version.
    """
    # (kind, version) -> (value flags, switch flags, node ids)
    seen: dict[tuple[str, str], tuple[frozenset[str], frozenset[str], list[str]]] = {}
    for node in report.get("nodes", []):
        if node.get("state") != "READY":
            continue
        for e in node.get("engines", []):
            if e.get("error") or not e.get("flags_listed"):
                continue
            key = (str(e.get("kind", "")).lower(), str(e.get("version", "")))
            if key not in seen:
                seen[key] = (
                    frozenset(e.get("value_flags", [])),
                    frozenset(e.get("switch_flags", [])),
                    [],
                )
            seen[key][2].append(str(node.get("node_id", "")))
    out = []
    for p in profiles:
        for (kind, version), (value, switch, nodes) in sorted(seen.items()):
            if not kind.endswith(p.engine):
                continue
            for flag in unknown_flags(p.engine, p.engine_args, value, switch):
                out.append(
                    f"models[{p.model}].profiles.{p.name}.engine_args: {flag!r} is not a flag "
                    f"{p.engine} {version or '(version unknown)'} accepts "
                    f"({_nodes_words(nodes)})"
                )
    return out
