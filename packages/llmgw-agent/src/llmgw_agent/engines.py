"""The engines installed on this node: kind, version, and the flags each accepts.

Read from the engines themselves: ``--version`` (or the package metadata for
``python -m sglang.launch_server``) and the help text, once per engine executable and
version, cached under ``state_dir/engine-help/`` because vLLM takes a minute to print
either. An executable whose path, size and modification time are unchanged is taken to be
the same version without asking it again. An engine whose help cannot be read is kept with its
error: Register carries it and every profile for it fails validation with that reason.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
from llmgw_proto import v1

from llmgw_agent.config import AgentConfig, EnginesConfig
from llmgw_agent.engine_flags import FlagSpec, captured, parse_help

__all__ = [
    "InstalledEngine",
    "help_argv",
    "load_engine",
    "load_installed",
    "metadata_version_argv",
    "parse_version",
    "reported_flags",
    "version_argv",
]

log = structlog.get_logger(__name__)

KIND_OF = {"vllm": v1.EngineKind.VLLM, "sglang": v1.EngineKind.SGLANG}
KIND_OF["llamacpp"] = v1.EngineKind.LLAMACPP

# (argv, timeout) -> (exit code, stdout + stderr)
Runner = Callable[[Sequence[str], float], tuple[int, str]]


@dataclass(frozen=True)
class InstalledEngine:
    kind: str
    executable: str
    version: str = ""
    spec: FlagSpec | None = None
    # Why the engine cannot be used; its profiles fail validation with it.
    error: str = ""

    def info(self) -> v1.EngineInfo:
        value_flags, switch_flags = reported_flags(self.spec)
        return v1.EngineInfo(
            kind=KIND_OF[self.kind],
            version=self.version,
            executable=self.executable,
            error=self.error,
            value_flags=value_flags,
            switch_flags=switch_flags,
            flags_listed=self.spec is not None and bool(value_flags or switch_flags),
        )


# What Register may carry of one engine's flags: the control plane's bounds.py refuses
# a Register past them (Bounds.engine_flags, Bounds.engine_flag), so past them none are
# sent (flags_listed false: the control plane then judges no flag of that engine).
FLAGS_MAX = 4096
FLAG_CHARS_MAX = 128


def reported_flags(spec: FlagSpec | None) -> tuple[list[str], list[str]]:
    """Pure: (value-taking, valueless) spellings of ``spec``'s options, sorted; both empty
    without a spec or when they would pass :data:`FLAGS_MAX` / :data:`FLAG_CHARS_MAX`."""
    if spec is None:
        return [], []
    names = spec.spellings()
    if len(names) > FLAGS_MAX or any(len(n) > FLAG_CHARS_MAX for n in names):
        return [], []
    value = sorted(n for n in names if spec.takes_value(n))
    switch = sorted(n for n in names if not spec.takes_value(n))
    return value, switch


def _run(argv: Sequence[str], timeout: float) -> tuple[int, str]:
    done = subprocess.run(
        list(argv),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=timeout,
        check=False,
        # The width the captured help texts were printed at.
        env={**os.environ, "COLUMNS": "80"},
    )
    return done.returncode, (done.stdout + done.stderr).decode(errors="replace")


def _python_module(command: Sequence[str]) -> str | None:
    """``sglang`` for ``python -m sglang.launch_server``."""
    if len(command) >= 3 and command[1] == "-m":
        return command[2].split(".")[0]
    return None


def version_argv(kind: str, command: Sequence[str]) -> list[str]:
    module = _python_module(command)
    if kind == "sglang" and module:
        # Importing sglang takes long and needs a GPU library: ask the package metadata.
        code = f"import importlib.metadata as m; print(m.version({module!r}))"
        return [command[0], "-c", code]
    return [*command, "--version"]


def _interpreter(exe: str) -> str | None:
    """The Python that runs ``exe``: itself (``python -m ...``, ``python bin/vllm``) or the
    interpreter on a console script's ``#!`` line; None for anything else."""
    if re.fullmatch(r"python[\d.]*", os.path.basename(exe)):
        return exe
    try:
        with open(exe, "rb") as script:
            first = script.readline(512)
    except OSError:
        return None
    words = first[2:].decode(errors="replace").split() if first.startswith(b"#!") else []
    if words and os.path.basename(words[0]) == "env":
        words = words[1:]
    if words and re.fullmatch(r"python[\d.]*", os.path.basename(words[0])):
        return words[0]
    return None


def metadata_version_argv(kind: str, exe: str) -> list[str] | None:
    """vLLM's version from its package metadata, in the Python that runs it: a fraction of
    a second where ``vllm --version`` imports all of vLLM (about 30 s of CPU). None when
    ``exe`` is no Python program; the caller falls back to ``--version``."""
    python = _interpreter(exe) if kind == "vllm" else None
    if python is None:
        return None
    code = "import importlib.metadata as m; print(m.version('vllm'))"
    return [python, "-c", code]


def help_argv(kind: str, command: Sequence[str]) -> list[str]:
    if kind == "vllm":
        return [*command, "serve", "--help=all"]
    return [*command, "--help"]


def parse_version(kind: str, text: str) -> str:
    """The version an engine printed: ``0.32.0``, or llama.cpp's build as ``b11434``.

    llama.cpp prints ``version: 11434 (a1b2c3)``, or since it numbers releases
    ``version: 0.6.0-dev (build 11434, commit a1b2c3)``; a build from a source archive
    has no build number (``build 0``) unless given one, and is known by its release."""
    if kind == "llamacpp":
        build = re.search(r"version:.*\bbuild (\d+)", text)
        if build and int(build.group(1)) > 0:
            return f"b{build.group(1)}"
        release = re.search(r"version:\s*(\d+\.\d+[.\w+-]*)", text)
        if release:
            return release.group(1)
        match = re.search(r"version:\s*(\d+)\b", text)
        return f"b{match.group(1)}" if match and int(match.group(1)) > 0 else ""
    found = re.findall(r"^\s*v?(\d+\.\d+(?:\.\d+)?(?:[.+\-\w]*)?)\s*$", text, re.MULTILINE)
    return found[-1] if found else ""


def _version_key(kind: str, command: Sequence[str], exe: str) -> str | None:
    """What identifies the engine's version without asking it (vLLM takes a minute to say).

    The executable's path, size and modification time change with every install. Not for
    ``python -m sglang...``: the interpreter stays when the package changes (its version
    comes from the package metadata, which is quick to ask anyway).
    """
    if _python_module(command):
        return None
    parts = [kind]
    # The executable and any script it runs ([python, /opt/x/bin/vllm]).
    for word in [exe, *command[1:]]:
        try:
            stat = os.stat(word)
        except OSError:
            parts.append(word)
            continue
        parts.append(f"{os.path.realpath(word)}:{stat.st_size}:{stat.st_mtime_ns}")
    return " ".join(parts) if parts[1] != exe else None


def _versions_file(state_dir: Path) -> Path:
    return state_dir / "engine-help" / "versions.json"


def _cached_version(kind: str, command: Sequence[str], exe: str, state_dir: Path) -> str:
    key = _version_key(kind, command, exe)
    if key is None:
        return ""
    try:
        known = json.loads(_versions_file(state_dir).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    value = known.get(key, "") if isinstance(known, dict) else ""
    return value if isinstance(value, str) else ""


def _cache_version(
    kind: str, command: Sequence[str], exe: str, state_dir: Path, version: str
) -> None:
    key = _version_key(kind, command, exe)
    if key is None:
        return
    path = _versions_file(state_dir)
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    known[key] = version
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(known, indent=1), encoding="utf-8")
        os.replace(tmp, path)


def _executable(command: Sequence[str]) -> str:
    exe = command[0] if command else ""
    if os.sep in exe:
        return exe
    return shutil.which(exe) or exe


def load_engine(
    kind: str,
    command: Sequence[str],
    flags_from: str,
    state_dir: Path,
    *,
    timeout: float = 300.0,
    run: Runner = _run,
    quiet: bool = False,
) -> InstalledEngine:
    """Read one engine's version and flags; problems end up in ``error``, never raised.

    ``quiet``: an engine agent.yaml does not set up; what goes wrong is logged at info.
    """
    exe = _executable(command)
    source = flags_from.strip()
    if source.startswith("captured"):
        _, _, wanted = source.partition(":")
        try:
            spec = captured(kind, wanted or None)
            return InstalledEngine(kind, exe, spec.version, spec)
        except (LookupError, ValueError) as err:
            return InstalledEngine(kind, exe, error=f"flags_from {source!r}: {err}")
    if source:
        path = Path(source).expanduser()
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
            return InstalledEngine(kind, exe, "", parse_help(kind, text))
        except (OSError, ValueError) as err:
            return InstalledEngine(kind, exe, error=f"flags_from {source!r}: {err}")
    if not command or (not (os.sep in exe and os.access(exe, os.X_OK)) and not shutil.which(exe)):
        return InstalledEngine(kind, exe, error=f"engine executable {exe!r} not found on PATH")
    version = _cached_version(kind, command, exe, state_dir)
    code, out = 0, ""
    quick = metadata_version_argv(kind, exe) if not version else None
    if quick is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            code, out = run(quick, timeout)
            version = parse_version(kind, out) if code == 0 else ""
    if not version:
        try:
            code, out = run(version_argv(kind, command), timeout)
        except (OSError, subprocess.SubprocessError) as err:
            code, out = -1, str(err)
        version = parse_version(kind, out) if code == 0 or kind == "llamacpp" else ""
        if version:
            _cache_version(kind, command, exe, state_dir, version)
    if not version:
        # The flags still come from the engine; only the cache needs a version.
        last = out.strip().splitlines()[-1:] or ["no output"]
        say = log.info if quiet else log.warning
        say("cannot read the engine version", engine=kind, exit=code, last=last[0][:200])
    key = hashlib.sha256(os.path.realpath(exe).encode()).hexdigest()[:12]
    cache = state_dir / "engine-help" / f"{kind}-{version}-{key}.txt" if version else None
    text = ""
    if cache is not None:
        with contextlib.suppress(OSError):
            text = cache.read_text(encoding="utf-8")
    if not text:
        argv = help_argv(kind, command)
        try:
            code, text = run(argv, timeout)
        except (OSError, subprocess.SubprocessError) as err:
            return InstalledEngine(
                kind, exe, version, error=f"cannot read `{' '.join(argv)}`: {err}"
            )
        if code != 0:
            return InstalledEngine(kind, exe, version, error=f"`{' '.join(argv)}` exited {code}")
    try:
        spec = parse_help(kind, text, version=version)
    except ValueError as err:
        return InstalledEngine(kind, exe, version, error=str(err))
    if cache is not None and not cache.exists():
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(".tmp")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, cache)
        except OSError as err:
            log.warning("cannot cache the engine help", path=str(cache), error=str(err))
    return InstalledEngine(kind, exe, version, spec)


def load_installed(
    config: AgentConfig, state_dir: Path, names: tuple[str, ...] = ("vllm", "sglang", "llamacpp")
) -> dict[str, InstalledEngine]:
    """Each engine kind's version and flags, as agent.yaml says to read them."""
    out: dict[str, InstalledEngine] = {}
    for name in names:
        engine = getattr(config.engines, name)
        configured = engine != getattr(EnginesConfig(), name)
        out[name] = load_engine(
            name,
            engine.command,
            engine.flags_from,
            state_dir,
            timeout=config.engine_probe_timeout,
            quiet=not configured,
        )
        if out[name].error:
            # An engine agent.yaml does not set up (its default command) that does not
            # run here: normal on a node for other engines. Only an engine the file
            # sets up is worth a warning; a profile that needs an unusable one fails
            # its start with this same error (status, explain and the page show it).
            if configured:
                log.warning("engine unusable", engine=name, error=out[name].error)
            else:
                log.info(
                    "engine not set up in agent.yaml and not usable at its default command;"
                    " fine unless a profile placed here needs it",
                    engine=name,
                    error=out[name].error,
                )
    return out
