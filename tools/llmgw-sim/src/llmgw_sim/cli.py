"""``llmgw-sim``: dispatch to the vLLM, SGLang or llama.cpp stand-in."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from llmgw_sim.flags import ENGINE_KINDS, EngineKind, known_flags, resolve_version
from llmgw_sim.knobs import KnobError, knob_help, load_knobs, split_sim_args

USAGE = """\
usage: llmgw-sim vllm serve MODEL [vLLM flags] [--sim-* knobs]
       llmgw-sim sglang --model-path MODEL [SGLang flags] [--sim-* knobs]
       llmgw-sim llama-server -m PATH [llama-server flags] [--sim-* knobs]
       llmgw-sim flags {vllm,sglang,llama-server} [VERSION]   (the accepted engine flags)
       llmgw-sim vllm --version

Engine simulator for llmgw: each engine's own flags, HTTP API, metrics,
start-up and failure behaviour, without a GPU.

simulation knobs (flag / environment variable):
"""


def _help() -> str:
    rows = [f"  {flag} / {env}\n      {desc}" for flag, env, desc in knob_help()]
    return USAGE + "\n".join(rows) + "\n"


def _print_version(rest: Sequence[str]) -> int:
    """``vllm --version``: the simulated version (``--sim-version`` or the newest captured)."""
    _, sim_args = split_sim_args(rest)
    try:
        wanted = load_knobs(sim_args, os.environ).version
        sys.stdout.write(resolve_version("vllm", wanted) + "\n")
    except (KnobError, ValueError) as err:
        sys.stderr.write(f"llmgw-sim: error: {err}\n")
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(_help())
        return 0 if args else 2
    command, rest = args[0], args[1:]
    # Imported late so `llmgw-sim --help` stays instant.
    from llmgw_sim.runner import run_engine

    if command == "vllm" and rest and rest[0] in ("--version", "-v"):
        return _print_version(rest[1:])
    if command == "vllm":
        if not rest or rest[0] != "serve":
            got = rest[0] if rest else "nothing"
            sys.stderr.write(f"llmgw-sim: only 'vllm serve' is simulated, got 'vllm {got}'\n")
            return 2
        return run_engine("vllm", rest[1:])
    if command == "sglang":
        return run_engine("sglang", rest)
    if command == "llama-server":
        return run_engine("llama-server", rest)
    if command == "flags":
        if len(rest) not in (1, 2) or rest[0] not in ENGINE_KINDS:
            sys.stderr.write("usage: llmgw-sim flags {vllm,sglang,llama-server} [VERSION]\n")
            return 2
        kind: EngineKind = rest[0]
        try:
            flags = known_flags(kind, rest[1] if len(rest) == 2 else None)
        except ValueError as err:
            sys.stderr.write(f"llmgw-sim: error: {err}\n")
            return 2
        sys.stdout.write("\n".join(sorted(flags)) + "\n")
        return 0
    sys.stderr.write(
        f"llmgw-sim: unknown engine {command!r}; expected vllm, sglang or llama-server\n"
    )
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
