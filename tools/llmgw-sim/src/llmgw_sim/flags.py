"""The engines' command lines, from the help text of named engine versions.

One source for engine flags (issue 12.2/16.3): the help a real engine prints, captured
in ``llmgw_agent/engine_help/`` and parsed by :mod:`llmgw_agent.engine_flags` (the same
parser the agent validates profiles with). The simulator accepts exactly the options of
the chosen version's help (``--sim-version`` picks one; the newest captured by
default) and refuses the rest the way the engine does: vLLM and SGLang (argparse) exit 2
with ``unrecognized arguments: ...``, llama-server exits 1 with
``error: invalid argument: ...``.

What the simulator *does* with a flag is the small typed table below (name, type,
default); every other accepted flag is only logged among the non-default args.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NoReturn

import yaml
from llmgw_agent.engine_flags import FlagSpec, captured_text, captured_versions, parse_help

EngineKind = Literal["vllm", "sglang", "llama-server"]
ENGINE_KINDS: tuple[EngineKind, ...] = ("vllm", "sglang", "llama-server")

PROGS: dict[EngineKind, str] = {
    "vllm": "vllm serve",
    "sglang": "python -m sglang.launch_server",
    "llama-server": "llama-server",
}
_AGENT_KIND: dict[EngineKind, str] = {
    "vllm": "vllm",
    "sglang": "sglang",
    "llama-server": "llamacpp",
}


def human_readable_int(value: str) -> int:
    """vLLM's size parser for --max-model-len and friends: 4096, 32k, 32K, 1m, 1M."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]?)", value.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"invalid human readable integer: {value!r}")
    number, suffix = match.groups()
    # vLLM reads a lowercase suffix as decimal and an uppercase one as binary.
    scale = {
        "": 1,
        "k": 10**3,
        "m": 10**6,
        "g": 10**9,
        "K": 2**10,
        "M": 2**20,
        "G": 2**30,
    }[suffix]
    result = float(number) * scale
    if not result.is_integer():
        raise argparse.ArgumentTypeError(f"not a whole number of tokens: {value!r}")
    return int(result)


# ----- versions and their help ---------------------------------------------------------


def _check_kind(kind: str) -> EngineKind:
    if kind not in _AGENT_KIND:
        raise ValueError(f"unknown engine kind {kind!r}; expected one of {', '.join(ENGINE_KINDS)}")
    return kind


def versions(kind: EngineKind) -> list[str]:
    """The versions whose help the simulator can stand in for, oldest first."""
    return captured_versions(_AGENT_KIND[_check_kind(kind)])


def resolve_version(kind: EngineKind, wanted: str | None) -> str:
    """The version to simulate: ``wanted`` (``0.32`` matches ``0.32.0``, ``11434`` matches
    ``b11434``), or the newest; ValueError naming the versions there are."""
    have = versions(kind)
    if not have:
        raise ValueError(f"no engine help captured for {kind}")
    if wanted is None:
        return have[-1]
    for version in reversed(have):
        core = version.lstrip("b")
        if wanted in (version, core) or version.startswith(wanted + ".") or core == wanted:
            return version
    raise ValueError(
        f"no captured {kind} help for version {wanted!r}; the simulator knows {', '.join(have)}"
    )


def help_text(kind: EngineKind, version: str | None = None) -> str:
    """The help text of that version, as the engine prints it."""
    return captured_text(_AGENT_KIND[kind], resolve_version(kind, version))[1]


@functools.cache
def spec(kind: EngineKind, version: str | None = None) -> FlagSpec:
    """The options that version accepts."""
    chosen = resolve_version(kind, version)
    return parse_help(_AGENT_KIND[kind], help_text(kind, chosen), version=chosen)


def known_flags(kind: EngineKind, version: str | None = None) -> frozenset[str]:
    """Every option string the simulator accepts for ``kind``: exactly its help's spellings."""
    return spec(_check_kind(kind), version).spellings()


# ----- what the simulator reads --------------------------------------------------------

Conv = Callable[[list[str]], object]


def _one(kind: Callable[[str], object]) -> Conv:
    return lambda values: kind(values[-1])


def _flag(values: list[str]) -> bool:
    # argparse's BooleanOptionalAction: --x is true, --no-x arrives as "false".
    return not (values and values[-1].lower() in ("false", "0", "no", "off"))


def _all(values: list[str]) -> list[str]:
    return list(values)


INT, FLOAT, STR, HINT = _one(int), _one(float), _one(str), _one(human_readable_int)


@dataclass(frozen=True)
class Typed:
    flag: str  # any spelling the help lists
    convert: Conv
    default: object = None
    type_name: str = "str"

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


def _t(flag: str, convert: Conv, default: object = None) -> Typed:
    names = {INT: "int", FLOAT: "float", HINT: "human readable int"}
    return Typed(flag, convert, default, names.get(convert, "str"))


TYPED: dict[EngineKind, tuple[Typed, ...]] = {
    "vllm": (
        _t("--model", STR, "Qwen/Qwen3-0.6B"),
        _t("--host", STR),
        _t("--port", INT, 8000),
        _t("--served-model-name", _all),
        _t("--api-key", _all),
        _t("--max-model-len", HINT),
        _t("--max-num-seqs", INT),
        _t("--max-num-batched-tokens", HINT),
        _t("--block-size", INT),
        _t("--enable-prefix-caching", _flag),
        _t("--num-gpu-blocks-override", INT),
        _t("--kv-cache-memory-bytes", HINT),
        _t("--kv-events-config", STR),
        _t("--tokenizer", STR),
        _t("--tensor-parallel-size", INT, 1),
        _t("--pipeline-parallel-size", INT, 1),
        _t("--data-parallel-size", INT, 1),
        _t("--data-parallel-size-local", INT),
        _t("--gpu-memory-utilization", FLOAT, 0.9),
        _t("--nnodes", INT, 1),
        _t("--node-rank", INT, 0),
        _t("--master-addr", STR, "127.0.0.1"),
        _t("--master-port", INT, 29501),
        _t("--headless", _flag, False),
        _t("--seed", INT, 0),
        _t("--enable-request-id-headers", _flag, False),
        _t("--lora-modules", _all),
        _t("--enable-lora", _flag, False),
        _t("--max-loras", INT, 1),
        _t("--max-lora-rank", INT, 16),
    ),
    "sglang": (
        _t("--model-path", STR),
        _t("--host", STR, "127.0.0.1"),
        _t("--port", INT, 30000),
        _t("--tensor-parallel-size", INT, 1),
        _t("--pipeline-parallel-size", INT, 1),
        _t("--data-parallel-size", INT, 1),
        _t("--served-model-name", STR),
        _t("--api-key", STR),
        _t("--context-length", INT),
        _t("--max-running-requests", INT),
        _t("--max-total-tokens", INT),
        _t("--chunked-prefill-size", INT),
        _t("--max-prefill-tokens", INT, 16384),
        _t("--page-size", INT, 1),
        _t("--disable-radix-cache", _flag, False),
        _t("--enable-metrics", _flag, False),
        _t("--mem-fraction-static", FLOAT),
        _t("--base-gpu-id", INT, 0),
        _t("--nnodes", INT, 1),
        _t("--node-rank", INT, 0),
        _t("--random-seed", INT),
        _t("--kv-events-config", STR),
        _t("--enable-lora", _flag, False),
        _t("--lora-paths", _all),
        _t("--max-loras-per-batch", INT, 8),
        _t("--max-lora-rank", INT),
        _t("--lora-target-modules", _all),
        _t("--disaggregation-mode", STR, "null"),
        _t("--disaggregation-bootstrap-port", INT, 8998),
    ),
    "llama-server": (
        _t("--model", STR),
        _t("--hf-repo", STR),
        _t("--host", STR, "127.0.0.1"),
        _t("--port", INT, 8080),
        _t("--ctx-size", INT, 4096),
        _t("--parallel", INT, -1),
        _t("--batch-size", INT, 2048),
        _t("--threads", INT, -1),
        _t("--alias", STR),
        _t("--api-key", STR),
        _t("--metrics", _flag, False),
        _t("--seed", INT, -1),
    ),
}


# ----- parsing -------------------------------------------------------------------------


def _fail(kind: EngineKind, message: str) -> NoReturn:
    if kind == "llama-server":
        # llama.cpp parses its own flags: "error: ..." and exit 1.
        sys.stderr.write(f"error: {message}\n")
        sys.exit(1)
    usage = (
        "usage: vllm serve [model_tag] [options]"
        if kind == "vllm"
        else (f"usage: {PROGS[kind]} [-h] --model-path MODEL_PATH [options]")
    )
    sys.stderr.write(f"{usage}\n{PROGS[kind]}: error: {message}\n")
    sys.exit(2)


_UNKNOWN = re.compile(r"^(?:unknown engine argument|unexpected positional argument) '(.*)'$")
_NEEDS = re.compile(r"^engine argument '(.*)' needs (a value|\d+ values)$")
_CHOICE = re.compile(r"^engine argument '(.*)': '(.*)' is not one of (.*)$")


def _report(kind: EngineKind, errors: list[str], argv: Sequence[str]) -> NoReturn:
    unknown: list[str] = []
    for err in errors:
        if (m := _UNKNOWN.match(err)) is not None:
            unknown.append(m.group(1))
        elif kind == "llama-server":
            _fail(kind, f"invalid argument: {err}")
        elif (m := _NEEDS.match(err)) is not None:
            _fail(kind, f"argument {m.group(1)}: expected one argument")
        elif (m := _CHOICE.match(err)) is not None:
            _fail(kind, f"argument {m.group(1)}: invalid choice: '{m.group(2)}' (choose from "
                  f"{m.group(3)})")  # fmt: skip
        else:
            _fail(kind, err)
    if kind == "llama-server":
        _fail(kind, f"invalid argument: {unknown[0]}")
    # argparse lists the leftover words, the values of unknown options among them.
    names = {u.partition("=")[0] for u in unknown}
    rest: list[str] = []
    taking = False
    for arg in argv:
        if arg.partition("=")[0] in names:
            rest.append(arg)
            taking = "=" not in arg
        elif taking and not arg.startswith("-"):
            rest.append(arg)
        else:
            taking = False
    _fail(kind, f"unrecognized arguments: {' '.join(rest or unknown)}")


def _print_and_exit(kind: EngineKind, args: Sequence[str], version: str | None) -> None:
    """``--help`` prints the version's own help text; llama-server's ``--version`` its build."""
    for arg in args:
        if arg in ("-h", "--help", "--usage") or arg.startswith("--help="):
            sys.stdout.write(help_text(kind, version))
            sys.exit(0)
        if kind == "llama-server" and arg == "--version":
            build = resolve_version(kind, version).lstrip("b")
            sys.stdout.write(f"version: {build} (llmgwsim)\nbuilt with cc for x86_64-linux-gnu\n")
            sys.exit(0)


def _with_options_file(kind: EngineKind, args: list[str]) -> list[str]:
    """SGLang's ``--config FILE.yaml``: the file's ``name: value`` pairs become
    ``--name value`` options placed before the command line's (which win), as its
    server_args_config_parser does; its refusals are SGLang's ValueErrors."""
    at = [i for i, arg in enumerate(args) if arg == "--config"]
    if not at:
        return args
    if len(at) > 1:
        _fail(kind, "Multiple config files specified! Only one allowed.")
    i = at[0]
    if i == len(args) - 1:
        _fail(kind, "No config file specified after --config flag!")
    path = Path(args[i + 1])
    if path.suffix.lower() not in (".yaml", ".yml"):
        _fail(kind, f"Config file must be YAML format, got: {path.suffix}")
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        _fail(kind, f"Config file not found: {path}")
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        _fail(kind, f"Failed to read config file {path}: {err}")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        _fail(kind, "Config file must contain a dictionary at root level")
    options: list[str] = []
    for key, value in data.items():
        if isinstance(value, bool):
            options.extend([f"--{key}"] if value else [])
        elif isinstance(value, list):
            options.extend([f"--{key}", *(str(v) for v in value)] if value else [])
        else:
            options.extend([f"--{key}", str(value)])
    return options + args[:i] + args[i + 2 :]


def parse_engine_args(
    kind: EngineKind, argv: Sequence[str], version: str | None = None
) -> argparse.Namespace:
    """Parse an engine's own command line; exits like the real engine on bad input.

    The namespace has one attribute per entry of :data:`TYPED` (its ``dest``), vLLM's
    positional ``model_tag``, and ``non_default_args`` (what the command line set)."""
    flags = spec(_check_kind(kind), version)
    args = list(argv)
    _print_and_exit(kind, args, version)
    if kind == "sglang":
        args = _with_options_file(kind, args)
    ns = argparse.Namespace()
    ns.model_tag = None
    if kind == "vllm" and args and not args[0].startswith("-"):
        ns.model_tag = args.pop(0)
    parsed = flags.parse(args)
    if parsed.errors:
        _report(kind, parsed.errors, args)
    if kind == "sglang" and not parsed.has("--model-path"):
        _fail(kind, "the following arguments are required: --model-path/--model")
    non_default: dict[str, object] = {}
    if ns.model_tag is not None:
        non_default["model_tag"] = ns.model_tag
    typed_keys: set[str] = set()
    for t in TYPED[kind]:
        option = flags.option(t.flag)
        value = t.default
        if option is not None:
            typed_keys.add(option.canonical)
            raw = parsed.values.get(option.canonical)
            if raw is not None:
                try:
                    value = t.convert(raw)
                except (ValueError, argparse.ArgumentTypeError, IndexError):
                    shown = raw[-1] if raw else ""
                    given = parsed.given.get(option.canonical, t.flag)
                    _fail(kind, f"argument {given}: invalid {t.type_name} value: '{shown}'")
                non_default[t.dest] = value
        setattr(ns, t.dest, value)
    for key, raw in parsed.values.items():
        if key in typed_keys:
            continue
        dest = key.lstrip("-").replace("-", "_")
        non_default[dest] = True if not raw else (raw[0] if len(raw) == 1 else list(raw))
    ns.non_default_args = non_default
    return ns
