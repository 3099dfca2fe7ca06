"""Which flags an engine accepts, read from the engine's own ``--help``.

One source for engine flags: the help text the engine itself prints (``vllm serve
--help=all``, ``python -m sglang.launch_server --help``, ``llama-server --help``). The
agent reads it from the installed engine at run time; the help of named versions is kept
in ``engine_help/`` (captured from the real engines) for the simulator and for tests.

Pure: text in, :class:`FlagSpec` out. The API others use::

    spec = parse_help("vllm", text, version="0.32.0")   # or captured("vllm", "0.32.0")
    spec.accepts("--max-model-len")       # True
    spec.takes_value("--enforce-eager")   # False
    spec.parse(["-tp", "2", "--enforce-eager"])  # ParsedArgs, errors naming each argument

Engine kinds are ``vllm``, ``sglang`` and ``llamacpp`` (``llama-server`` is accepted as
another name for the last).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources

__all__ = [
    "KINDS",
    "FlagSpec",
    "Option",
    "ParsedArgs",
    "captured",
    "captured_versions",
    "normalize_kind",
    "parse_help",
]

KINDS = ("vllm", "sglang", "llamacpp")
# The file name prefix of each kind's captured help: engine_help/<prefix>-<version>.txt.
_FILE_PREFIX = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llama-server"}
_KIND_ALIASES = {"llama-server": "llamacpp", "llama.cpp": "llamacpp", "llama_cpp": "llamacpp"}
# Options that print something and exit: accepted by the engine, never part of a profile.
_EXITS = frozenset(
    {"-h", "--help", "--usage", "--version", "--completion-bash", "-cl", "--cache-list"}
)


def normalize_kind(kind: str) -> str:
    """``vllm``, ``sglang`` or ``llamacpp``; ValueError naming the valid kinds."""
    name = _KIND_ALIASES.get(kind.lower(), kind.lower())
    if name not in KINDS:
        raise ValueError(f"unknown engine kind {kind!r}: expected one of {', '.join(KINDS)}")
    return name


@dataclass(frozen=True)
class Option:
    """One option of the engine: every spelling of it and how many values it takes."""

    names: tuple[str, ...]
    min_values: int
    # None: no upper limit (argparse nargs "+" or "*").
    max_values: int | None
    # The values it accepts, when the help lists them ({a,b} or ['a', 'b']).
    choices: tuple[str, ...] = ()

    @property
    def canonical(self) -> str:
        """The first long spelling: the name results are keyed by."""
        return next((n for n in self.names if n.startswith("--")), self.names[0])

    @property
    def takes_value(self) -> bool:
        return self.max_values != 0


@dataclass(frozen=True)
class ParsedArgs:
    """engine_args as the engine would read them, keyed by canonical option name."""

    spec: FlagSpec = field(repr=False)
    values: dict[str, list[str]]
    errors: list[str]
    # The spelling each option was given as, for messages ("--model" rather than "--model-path").
    given: dict[str, str] = field(default_factory=dict)

    def _key(self, flag: str) -> str:
        option = self.spec.option(flag)
        return option.canonical if option else flag

    def has(self, *flags: str) -> bool:
        return any(self._key(f) in self.values for f in flags)

    def first(self, *flags: str) -> str | None:
        for f in flags:
            taken = self.values.get(self._key(f))
            if taken:
                return taken[0]
        return None


@dataclass(frozen=True)
class FlagSpec:
    """The options one engine version accepts."""

    kind: str
    version: str
    options: tuple[Option, ...]
    _by_name: Mapping[str, Option] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self._by_name:
            by_name = {name: o for o in self.options for name in o.names}
            object.__setattr__(self, "_by_name", by_name)

    # ---- lookups ----------------------------------------------------------------------

    def option(self, flag: str) -> Option | None:
        """The option ``flag`` names (``--x=v`` and vLLM's ``--x_y`` and ``--x.key`` too)."""
        name = flag.partition("=")[0]
        found = self._by_name.get(name)
        if found is not None or not name.startswith("--"):
            return found
        if self.kind == "vllm":
            # vLLM turns underscores into dashes up to the first '.', and reads
            # --json-arg.key value as a key of a JSON option.
            head, dot, _ = name.partition(".")
            head = head.replace("_", "-")
            found = self._by_name.get(head)
            if found is not None and (not dot or found.takes_value):
                return found
        return None

    def accepts(self, flag: str) -> bool:
        return self.option(flag) is not None

    def takes_value(self, flag: str) -> bool:
        option = self.option(flag)
        return option is not None and option.takes_value

    def spellings(self) -> frozenset[str]:
        """Every spelling the help lists, the print-and-exit ones left out."""
        return frozenset(n for n in self._by_name if n not in _EXITS)

    # ---- parsing ----------------------------------------------------------------------

    def parse(self, args: Sequence[str]) -> ParsedArgs:
        """Read ``args`` as the engine would; every problem names the argument."""
        values: dict[str, list[str]] = {}
        given: dict[str, str] = {}
        errors: list[str] = []
        i = 0
        while i < len(args):
            arg = args[i]
            i += 1
            inline: str | None = None
            if self.kind == "vllm" and arg.startswith("-O") and arg != "-O":
                # vLLM's -O3 / -O=3 / -Odecode is --optimization-level.
                inline = arg[3:] if arg[2:3] == "=" else arg[2:]
                arg = "--optimization-level"
            if not arg.startswith("-") or arg in ("-", "--"):
                errors.append(f"unexpected positional argument {arg!r}")
                continue
            name, eq, rest = arg.partition("=")
            if eq:
                inline = rest
            option = self.option(name)
            if option is None and self.kind != "llamacpp" and not name.startswith("--"):
                # argparse reads "-tp2" as "-tp 2".
                option, inline = self._attached(name, inline)
            if option is None:
                errors.append(f"unknown engine argument {name!r}")
                continue
            key = option.canonical
            given[key] = name
            if name in _EXITS:
                errors.append(f"engine argument {name!r} prints something and exits")
                continue
            if not option.takes_value:
                negated = name.startswith("--no-") and key == "--" + name[5:]
                if inline is None and negated and self.kind != "llamacpp":
                    inline = "false"  # argparse's BooleanOptionalAction: --no-x sets x false
                values[key] = [inline] if inline is not None else []
                continue
            if inline is not None:
                values[key] = [*values.get(key, []), inline] if "." in name else [inline]
                continue
            taken: list[str] = []
            limit = option.max_values
            while i < len(args) and (limit is None or len(taken) < limit):
                if self._looks_like_flag(args[i]):
                    break
                taken.append(args[i])
                i += 1
            if len(taken) < option.min_values:
                need = "a value" if option.min_values == 1 else f"{option.min_values} values"
                errors.append(f"engine argument {name!r} needs {need}")
                continue
            if option.choices and self.kind != "llamacpp":
                bad = [v for v in taken if v not in option.choices]
                if bad:
                    errors.append(
                        f"engine argument {name!r}: {bad[0]!r} is not one of "
                        f"{', '.join(option.choices)}"
                    )
                    continue
            values[key] = taken
        return ParsedArgs(self, values, errors, given)

    def _attached(self, name: str, inline: str | None) -> tuple[Option | None, str | None]:
        for cut in range(len(name) - 1, 1, -1):
            option = self._by_name.get(name[:cut])
            if option is not None and option.takes_value:
                return option, name[cut:] if inline is None else f"{name[cut:]}={inline}"
        return None, inline

    def _looks_like_flag(self, arg: str) -> bool:
        # Negative numbers ("--seed -1") are values, as in argparse and llama.cpp.
        if re.fullmatch(r"-\d+(\.\d+)?", arg):
            return False
        if self.kind == "llamacpp":
            return arg.partition("=")[0] in self._by_name
        return arg.startswith("-") and arg != "-"


# ---- help text parsers ------------------------------------------------------------------

# argparse indents every option by exactly two spaces; description lines sit deeper.
_ARGPARSE_OPTION = re.compile(r"^  (-{1,2}[A-Za-z0-9][^\s,=]*)(.*)$")
_NAME = re.compile(r"^-{1,2}[A-Za-z0-9][\w.+-]*$")


def _split_top(text: str, sep: str) -> list[str]:
    """Split on ``sep`` outside brackets, braces and quotes."""
    out, depth, quote, current = [], 0, "", ""
    i = 0
    while i < len(text):
        ch = text[i]
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif depth == 0 and text.startswith(sep, i):
            out.append(current)
            current = ""
            i += len(sep)
            continue
        current += ch
        i += 1
    out.append(current)
    return out


def _choices(metavar: str) -> tuple[str, ...]:
    # Only a metavar that is nothing but the list: "{a,b} or a plugin's name" is free-form.
    if re.fullmatch(r"\{[^}]*\}", metavar):
        return tuple(c.strip() for c in metavar[1 : metavar.index("}")].split(","))
    if re.fullmatch(r"\['[^\]]*\]", metavar):
        # vLLM prints some choices as a Python list: ['auto', 'hf', 'mistral'].
        return tuple(re.findall(r"'([^']*)'", metavar[: metavar.index("]") + 1]))
    return ()


def _argparse_arity(metavar: str) -> tuple[int, int | None]:
    """(min, max) values from an argparse metavar: ``X``, ``[X]``, ``X [X ...]``, ``{a,b}``."""
    words = _split_top(metavar.strip(), " ")
    words = [w for w in words if w]
    if not words:
        return 0, 0
    if words[-1].endswith("...]"):
        # "X [X ...]" is nargs="+", "[X ...]" is nargs="*".
        return (0 if len(words) == 1 else 1), None
    if len(words) == 1 and words[0].startswith("[") and words[0][1:2] not in ("'", '"'):
        return 0, 1
    # "{a,b} or name registered in --tool-parser-plugin": one value described in words.
    if len(words) > 1 and all(re.fullmatch(r"[A-Z][A-Z0-9_]*", w) for w in words):
        return len(words), len(words)
    return 1, 1


def _parse_argparse(text: str) -> list[Option]:
    options: list[Option] = []
    for line in text.splitlines():
        if not _ARGPARSE_OPTION.match(line):
            continue
        # The description starts after two spaces (or on the next line).
        spec = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        names: list[str] = []
        metavar = ""
        for i, invocation in enumerate(_split_top(spec, ", ")):
            name, _, rest = invocation.strip().partition(" ")
            if not _NAME.match(name):
                break
            names.append(name)
            if i == 0:
                metavar = rest.strip()
        if not names:
            continue
        low, high = _argparse_arity(metavar)
        options.append(Option(tuple(names), low, high, _choices(metavar)))
    return options


_LLAMA_NAME = re.compile(r"(?:^|(?<=[\s,]))(--?[A-Za-z][\w.-]*)")


def _parse_llamacpp(text: str) -> list[Option]:
    """llama.cpp's own layout: ``-c,    --ctx-size N`` with the description at column 40."""
    options: list[Option] = []
    for line in text.splitlines():
        if not line.startswith("-") or line.startswith("-----"):
            continue
        spec = line[:40] if len(line) > 40 and line[39] == " " else line
        names: list[str] = []
        rest = spec
        while True:
            match = re.match(r"\s*(--?[A-Za-z][\w.-]*)\s*(,?)", rest)
            if not match:
                break
            names.append(match.group(1))
            rest = rest[match.end() :]
            if not match.group(2):
                break
        placeholder = rest.strip()
        if not names:
            continue
        if not placeholder:
            low, high = 0, 0
        elif re.fullmatch(r"\[[^\]]*\]", placeholder):
            low, high = 0, 1  # -fa [on|off|auto]: the value may be left out
        elif re.fullmatch(r"[A-Z][A-Z0-9_]*( [A-Z][A-Z0-9_]*)+", placeholder):
            low = high = len(placeholder.split())  # START END
        else:
            low, high = 1, 1
        choices = tuple(placeholder[1:-1].split(",")) if placeholder.startswith("{") else ()
        options.append(Option(tuple(names), low, high, choices))
    return options


def parse_help(kind: str, text: str, *, version: str = "") -> FlagSpec:
    """The options an engine's help text lists; ValueError when it lists none."""
    name = normalize_kind(kind)
    options = _parse_llamacpp(text) if name == "llamacpp" else _parse_argparse(text)
    if not options:
        raise ValueError(f"no options found in the {name} help text")
    return FlagSpec(name, version, tuple(_merge(options)))


def _merge(options: Iterable[Option]) -> list[Option]:
    # An option listed twice (argparse groups repeat nothing, but be safe): first wins.
    seen: set[str] = set()
    out: list[Option] = []
    for option in options:
        names = tuple(n for n in option.names if n not in seen)
        if names:
            seen.update(names)
            out.append(Option(names, option.min_values, option.max_values, option.choices))
    return out


# ---- captured help of named versions ----------------------------------------------------


def _help_files() -> dict[tuple[str, str], str]:
    """(kind, version) -> file name of every captured help text."""
    out: dict[tuple[str, str], str] = {}
    folder = resources.files("llmgw_agent") / "engine_help"
    for entry in folder.iterdir():
        if not entry.name.endswith(".txt"):
            continue
        for kind, prefix in _FILE_PREFIX.items():
            if entry.name.startswith(prefix + "-"):
                out[(kind, entry.name[len(prefix) + 1 : -4])] = entry.name
    return out


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version))


def captured_versions(kind: str) -> list[str]:
    """The versions whose help is kept in the repository, oldest first."""
    name = normalize_kind(kind)
    return sorted((v for k, v in _help_files() if k == name), key=_version_key)


def captured_text(kind: str, version: str | None = None) -> tuple[str, str]:
    """(version, help text) of a captured version; the newest when ``version`` is None."""
    name = normalize_kind(kind)
    versions = captured_versions(name)
    if not versions:
        raise LookupError(f"no captured help for {name}")
    chosen = versions[-1] if version is None else version
    files = _help_files()
    if (name, chosen) not in files:
        raise LookupError(
            f"no captured help for {name} {chosen}: captured are {', '.join(versions)}"
        )
    folder = resources.files("llmgw_agent") / "engine_help"
    return chosen, (folder / files[(name, chosen)]).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=16)
def captured(kind: str, version: str | None = None) -> FlagSpec:
    """The FlagSpec of a captured version (``captured("vllm", "0.32.0")``); newest if None.

    Parsed once per process (a FlagSpec is immutable).
    """
    chosen, text = captured_text(kind, version)
    return parse_help(kind, text, version=chosen)
