"""``llmgw-sim``: dispatch to the vLLM, SGLang or llama.cpp stand-in."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from llmgw_sim.flags import known_flags
from llmgw_sim.knobs import knob_help

USAGE = """\
usage: llmgw-sim vllm serve MODEL [vLLM flags] [--sim-* knobs]
       llmgw-sim sglang --model-path MODEL [SGLang flags] [--sim-* knobs]
       llmgw-sim llama-server -m PATH [llama-server flags] [--sim-* knobs]
       llmgw-sim flags {vllm,sglang,llama-server}   (list the accepted engine flags)

Engine simulator for llmgw: each engine's own flags, HTTP API, metrics,
start-up and failure behaviour, without a GPU.

simulation knobs (flag / environment variable):
"""


def _help() -> str:
    rows = [f"  {flag} / {env}\n      {desc}" for flag, env, desc in knob_help()]
    return USAGE + "\n".join(rows) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(_help())
        return 0 if args else 2
    command, rest = args[0], args[1:]
    # Imported late so `llmgw-sim --help` stays instant.
    from llmgw_sim.runner import run_engine

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
        if len(rest) != 1 or rest[0] not in ("vllm", "sglang", "llama-server"):
            sys.stderr.write("usage: llmgw-sim flags {vllm,sglang,llama-server}\n")
            return 2
        kind = rest[0]
        sys.stdout.write("\n".join(sorted(known_flags(kind))) + "\n")  # type: ignore[arg-type]
        return 0
    sys.stderr.write(
        f"llmgw-sim: unknown engine {command!r}; expected vllm, sglang or llama-server\n"
    )
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
