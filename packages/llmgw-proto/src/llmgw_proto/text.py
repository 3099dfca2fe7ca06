"""Text from elsewhere made safe to print on a terminal.

Node labels, node ids, engine output and reasons come from agents; printed raw, an
ESC or BEL sequence in one of them would retitle, clear or rewrite the reader's
terminal (kubectl escapes these since CVE-2021-25743). :func:`visible` writes every
control character as its escape, so ``"\\x1b]0;x\\x07"`` prints as ``\\x1b]0;x\\x07``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["visible", "visible_data"]

# Not control characters by category, but they reorder or break the lines around
# them on a terminal (bidirectional overrides: "Trojan Source"; line separators).
_INVISIBLE = frozenset(
    [0x200E, 0x200F, 0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
)


def _escape(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def _unsafe(code: int) -> bool:
    # C0 (NUL..US, ESC and BEL among them), DEL, C1 (0x80..0x9f, CSI among them).
    return code < 0x20 or 0x7F <= code <= 0x9F or code in _INVISIBLE


def visible(text: str) -> str:
    """``text`` with every control character written as ``\\xNN`` (``\\uNNNN`` above 0xff).

    Newlines and tabs are escaped too: one value stays on one line of a table.
    Text without control characters comes back unchanged.
    """
    if all(not _unsafe(ord(ch)) for ch in text):
        return text
    return "".join(_escape(ch) if _unsafe(ord(ch)) else ch for ch in text)


def visible_data(value: Any) -> Any:
    """A copy of decoded JSON with :func:`visible` applied to every string, keys included."""
    if isinstance(value, str):
        return visible(value)
    if isinstance(value, dict):
        return {visible_data(k): visible_data(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [visible_data(v) for v in value]
    return value
