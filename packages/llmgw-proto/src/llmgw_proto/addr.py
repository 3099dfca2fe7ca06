"""HOST:PORT, once: parsing and formatting network addresses, IPv6 included.

Every program takes addresses in config and flags (``0.0.0.0:7070``, ``[::1]:7070``,
``ctl.internal:7070``) and writes them into URLs and logs. IPv6 hosts are bracketed
wherever a port follows them, and nowhere else.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["HostPort", "bracket", "format_hostport", "parse_hostport", "url_host"]


class HostPort(NamedTuple):
    host: str  # never bracketed: "::1", not "[::1]"
    port: int

    def __str__(self) -> str:
        return format_hostport(self.host, self.port)


def bracket(host: str) -> str:
    """``::1`` → ``[::1]``; other hosts unchanged. Idempotent."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]"
    return host


url_host = bracket  # the host part of a URL is bracketed the same way


def format_hostport(host: str, port: int) -> str:
    return f"{bracket(host)}:{port}"


def parse_hostport(
    value: str, *, default_host: str | None = None, allow_port_zero: bool = False
) -> HostPort:
    """``"0.0.0.0:7070"``, ``"[::1]:7070"`` or ``"name:7070"``; ValueError saying why not.

    ``default_host`` fills in ``":7070"``; without it an empty host is an error.
    """
    text = value.strip()
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError(f"expected HOST:PORT, got {value!r}: unclosed '['")
        host, rest = text[1:end], text[end + 1 :]
        if not rest.startswith(":"):
            raise ValueError(f"expected [HOST]:PORT, got {value!r}: no port after ']'")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError(f"expected HOST:PORT, got {value!r}: no port")
        if ":" in host:
            raise ValueError(f"expected HOST:PORT, got {value!r}: write an IPv6 host as [{host}]")
    if not port_text.isdigit():
        raise ValueError(f"expected HOST:PORT, got {value!r}: port {port_text!r} is not a number")
    port = int(port_text)
    low = 0 if allow_port_zero else 1
    if not low <= port <= 65535:
        raise ValueError(f"expected HOST:PORT, got {value!r}: port {port} is not in {low}-65535")
    if not host:
        if default_host is None:
            raise ValueError(f"expected HOST:PORT, got {value!r}: no host")
        host = default_host
    return HostPort(host, port)
