"""Sizes, once: ``80G``, ``80Gi``, ``80GB``, ``80GiB``, ``512M``, or a plain number of bytes.

One grammar for every program. Decimal units (``k``, ``M``, ``G``, ``T`` with or without a
trailing ``B``) are powers of 1000 and binary units (``Ki`` … ``Ti``, with or without ``B``)
powers of 1024, as GPU vendors and Kubernetes write them. Case does not matter.
"""

from __future__ import annotations

import re

__all__ = ["parse_size"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    _UNITS[_p] = _UNITS[_p + "b"] = 1000**_i
    _UNITS[_p + "i"] = _UNITS[_p + "ib"] = 1024**_i


def parse_size(value: object) -> int:
    """Bytes from a size; ValueError naming what was given otherwise."""
    if isinstance(value, bool):
        raise ValueError("expected a size like `80GiB` or `141GB`, got a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"expected a size >= 0, got {value}")
        return value
    if isinstance(value, float):
        if value < 0:
            raise ValueError(f"expected a size >= 0, got {value}")
        return int(value)
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match and match.group(2).lower() in _UNITS:
            return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    raise ValueError(f"expected a size like `80GiB`, `80G` or `141GB`, got {value!r}")
