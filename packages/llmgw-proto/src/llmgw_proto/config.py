"""One way to load a program's config file.

Each program declares its config as msgspec Structs (``forbid_unknown_fields``)
and calls :func:`load`. YAML or TOML is chosen by the file's extension. Any
problem becomes a :class:`ConfigError` that names the file and the field:

    control.yaml: $.models[0].profiles.fast.gpus_per_node: Expected `int` >= 1
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml

__all__ = ["BaseConfig", "ConfigError", "Duration", "convert", "load", "parse_duration"]

T = TypeVar("T")


class BaseConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base for config Structs: unknown fields are errors, fields are keyword-only."""


class ConfigError(Exception):
    """A config problem, located by file and JSON path."""

    def __init__(self, source: str, message: str, field: str = "") -> None:
        self.source = source
        self.field = field
        self.message = message
        where = f"{source}: {field}" if field else source
        super().__init__(f"{where}: {message}")


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")


def parse_duration(value: object) -> float:
    """Seconds from ``2.5``, ``"500ms"``, ``"5s"``, ``"2m"`` or ``"1h"``."""
    if isinstance(value, bool):
        raise ValueError("Expected a duration like `5s`, `500ms` or `2m`, got a boolean")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError("Expected a duration >= 0")
        return float(value)
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match:
            return float(match.group(1)) * _UNITS[match.group(2) or "s"]
    raise ValueError(f"Expected a duration like `5s`, `500ms` or `2m`, got {value!r}")


class Duration(float):
    """Seconds, written in config as a number or as ``500ms``/``5s``/``2m``/``1h``."""

    __slots__ = ()


def _dec_hook(type_: type, obj: Any) -> Any:
    if type_ is Duration:
        # A ValueError here comes back from msgspec as a ValidationError with the path.
        return Duration(parse_duration(obj))
    raise NotImplementedError(f"no decoder for {type_!r}")


_AT = re.compile(r"^(?P<msg>.*?) - at `(?P<path>[^`]*)`$", re.DOTALL)


def _convert(data: object, type_: type[T]) -> tuple[T | None, str, str]:
    try:
        return msgspec.convert(data, type_, dec_hook=_dec_hook, str_keys=True), "", ""
    except msgspec.ValidationError as err:
        match = _AT.match(str(err))
        if match:
            return None, match.group("msg"), match.group("path")
        return None, str(err), "$"


_SEGMENT = re.compile(r"\.([A-Za-z_][\w-]*)|\[(\d+)\]|\[\.\.\.\]")


def _name_keys(data: object, type_: type[Any], path: str) -> str:
    """Replace msgspec's ``[...]`` (a dict key it does not name) with the real key.

    For each ``[...]`` in the path, convert again with only one key of that dict
    kept; the key whose value fails the same way is the one to name.
    """
    if "[...]" not in path:
        return path
    node: Any = data
    named = "$"
    rest = path[1:]
    while rest:
        match = _SEGMENT.match(rest)
        if match is None:
            return named + rest
        segment = match.group(0)
        rest = rest[len(segment) :]
        if segment == "[...]":
            if not isinstance(node, dict):
                return named + segment + rest
            culprit = None
            for key in node:
                trial = _replace_at(data, named, {key: node[key]})
                _, _, trial_path = _convert(trial, type_)
                if trial_path.startswith(named + "[...]"):
                    culprit = key
                    break
            if culprit is None:
                return named + segment + rest
            key_text = str(culprit)
            named += (
                f".{key_text}" if re.fullmatch(r"[A-Za-z_][\w-]*", key_text) else f"[{key_text!r}]"
            )
            node = node[culprit]
        elif match.group(1) is not None:
            named += segment
            node = node.get(match.group(1)) if isinstance(node, dict) else None
        else:
            named += segment
            index = int(match.group(2))
            node = node[index] if isinstance(node, list) and index < len(node) else None
    return named


def _replace_at(data: object, named_path: str, value: object) -> object:
    """A copy of ``data`` with the node at ``named_path`` (as built above) replaced."""
    import copy

    root = copy.deepcopy(data)
    if named_path == "$":
        return value
    parent: Any = None
    key: Any = None
    node: Any = root
    rest = named_path[1:]
    while rest:
        match = re.match(r"\.([A-Za-z_][\w-]*)|\[(\d+)\]|\[('(?:[^'\\]|\\.)*')\]", rest)
        if match is None:
            return root
        rest = rest[len(match.group(0)) :]
        if match.group(1) is not None:
            key = match.group(1)
        elif match.group(2) is not None:
            key = int(match.group(2))
        else:
            import ast

            key = ast.literal_eval(match.group(3))
        parent, node = node, node[key]
    parent[key] = value
    return root


_PATH_PART = re.compile(r"\.([A-Za-z_][\w-]*)|\[(\d+)\]|\[\.\.\.\]|\[('(?:[^'\\]|\\.)*')\]")


def _type_at(type_: type[Any], path: str) -> msgspec.inspect.Type | None:
    """The msgspec type found at a JSON path of a config type, or None where unsure."""
    node: msgspec.inspect.Type = msgspec.inspect.type_info(type_)
    rest = path[1:]
    while True:
        while isinstance(node, msgspec.inspect.UnionType):
            inner: list[msgspec.inspect.Type] = [
                t for t in node.types if not isinstance(t, msgspec.inspect.NoneType)
            ]
            if len(inner) != 1:
                containers: list[msgspec.inspect.Type] = [
                    t
                    for t in inner
                    if isinstance(
                        t,
                        msgspec.inspect.StructType
                        | msgspec.inspect.DictType
                        | msgspec.inspect.ListType,
                    )
                ]
                if len(containers) != 1:
                    return node if not rest else None
                inner = containers
            node = inner[0]
        if isinstance(node, msgspec.inspect.Metadata):
            node = node.type
            continue
        if not rest:
            return node
        match = _PATH_PART.match(rest)
        if match is None:
            return None
        rest = rest[len(match.group(0)) :]
        if match.group(1) is not None:
            if not isinstance(node, msgspec.inspect.StructType):
                return None
            fields = {f.encode_name: f.type for f in node.fields}
            if match.group(1) not in fields:
                return None
            node = fields[match.group(1)]
        elif isinstance(node, msgspec.inspect.ListType | msgspec.inspect.SetType):
            node = node.item_type
        elif isinstance(node, msgspec.inspect.DictType):
            node = node.value_type
        else:
            return None


def _type_at_field(type_: type[Any], path: str) -> msgspec.inspect.Type | None:
    """The declared type of the field at ``path``, unions kept whole."""
    parent, sep, name = path.rpartition(".")
    if not sep:
        return None
    container = _type_at(type_, parent)
    if isinstance(container, msgspec.inspect.StructType):
        for field in container.fields:
            if field.encode_name == name:
                inner = field.type
                return inner.type if isinstance(inner, msgspec.inspect.Metadata) else inner
    return None


_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]*)`$")


def _helpful(message: str, type_: type[Any], path: str) -> str:
    """Say what would have been valid: the enum's values, the nearest field name."""
    import difflib

    if message.startswith("Invalid enum value"):
        found = _type_at(type_, path)
        values: list[str] = []
        if isinstance(found, msgspec.inspect.EnumType):
            values = [str(m.value) for m in found.cls]
        elif isinstance(found, msgspec.inspect.LiteralType):
            values = [str(v) for v in found.values]
        if values:
            return f"{message}: expected one of {', '.join(repr(v) for v in values)}"
    if message.startswith("Expected `") and "object" in message:
        # A number-or-object field (``replicas: 2`` or ``replicas: {min: 1, max: 4}``):
        # say which fields the object form takes.
        found = msgspec.inspect.type_info(type_) if path == "$" else _type_at_field(type_, path)
        structs = [
            t for t in getattr(found, "types", ()) if isinstance(t, msgspec.inspect.StructType)
        ]
        if len(structs) == 1:
            fields = ", ".join(f.encode_name for f in structs[0].fields)
            return f"{message} (the object form has the fields {fields})"
    unknown = _UNKNOWN.match(message)
    if unknown:
        found = _type_at(type_, path)
        if isinstance(found, msgspec.inspect.StructType):
            names = [f.encode_name for f in found.fields]
            close = difflib.get_close_matches(unknown.group("name"), names, n=1, cutoff=0.6)
            if close:
                return f"{message}: did you mean `{close[0]}`?"
            return f"{message}: known fields are {', '.join(names)}"
    return message


def convert(data: object, type_: type[T], *, source: str) -> T:
    """Turn already-parsed data into ``type_``, or raise a located :class:`ConfigError`."""
    value, message, path = _convert(data, type_)
    if value is None:
        raise ConfigError(source, _helpful(message, type_, path), _name_keys(data, type_, path))
    return value


def read(path: Path) -> object:
    """Parse ``path`` as YAML or TOML by its extension."""
    suffix = path.suffix.lower()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(str(path), f"cannot read: {err.strerror or err}") from None
    if suffix in (".yaml", ".yml"):
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
            problem = getattr(err, "problem", None) or str(err)
            raise ConfigError(str(path), f"{where}invalid YAML: {problem}") from None
    elif suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(str(path), f"invalid TOML: {err}") from None
    else:
        raise ConfigError(str(path), f"unknown config format {suffix!r}: use .yaml, .yml or .toml")
    return {} if data is None else data


def load(path: str | Path, type_: type[T]) -> T:
    """Read and validate a config file; errors name ``path`` and the field."""
    p = Path(path)
    return convert(read(p), type_, source=str(path))
