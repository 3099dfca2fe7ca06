"""HOST:PORT, once: parsing and formatting network addresses, IPv6 included.

Every program takes addresses in config and flags (``0.0.0.0:7070``, ``[::1]:7070``,
``ctl.internal:7070``) and writes them into URLs and logs. IPv6 hosts are bracketed
wherever a port follows them, and nowhere else.
"""

from __future__ import annotations

import ipaddress
import re
from typing import NamedTuple
from urllib.parse import urlsplit

__all__ = [
    "EndpointURL",
    "HostPort",
    "bracket",
    "format_hostport",
    "parse_endpoint_url",
    "parse_hostport",
    "url_host",
]


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


class EndpointURL(NamedTuple):
    """An engine's base URL, parsed: what a router dials."""

    scheme: str  # "http" or "https"
    host: str  # never bracketed
    port: int  # 1..65535; the scheme's default when the URL names none
    path: str

    def __str__(self) -> str:
        return f"{self.scheme}://{format_hostport(self.host, self.port)}{self.path}"


# A DNS name or an IPv4 address: letters, digits, dots, hyphens (underscores occur).
_NAME = re.compile(r"[A-Za-z0-9._-]+")
_DEFAULT_PORT = {"http": 80, "https": 443}


def parse_endpoint_url(url: str) -> EndpointURL:
    """An engine endpoint URL, strictly; ValueError naming the URL and what is wrong.

    The one rule the control plane (before it publishes an endpoint) and the router
    (before it dials one) share: scheme ``http`` or ``https``, a host (a name, an IPv4
    address or a bracketed IPv6 one), a port in 1..65535 (the scheme's default if
    none), no user info, query or fragment, and nothing invisible. Pure.
    """

    def bad(why: str) -> ValueError:
        return ValueError(f"endpoint URL {url!r}: {why}")

    if not isinstance(url, str):
        raise ValueError(f"endpoint URL {url!r}: not a string")
    if not url:
        raise bad("empty")
    if any(ch.isspace() or not ch.isprintable() for ch in url):
        raise bad("contains whitespace or control characters")
    if not url.isascii():
        raise bad("contains non-ASCII characters (write a host name in its xn-- form)")
    scheme, sep, _ = url.partition("://")
    if not sep:
        raise bad("expected http://HOST:PORT")
    scheme = scheme.lower()
    if scheme not in _DEFAULT_PORT:
        raise bad(f"scheme {scheme!r} is not http or https")
    try:
        parts = urlsplit(url)
    except ValueError as err:
        raise bad(str(err)) from None
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise bad("a query or fragment has no place in an endpoint URL")
    netloc = parts.netloc
    if "@" in netloc:
        raise bad("user info (USER@) has no place in an endpoint URL")
    if netloc.startswith("["):
        end = netloc.find("]")
        if end < 0:
            raise bad("unclosed '[' around an IPv6 host")
        host, after = netloc[1:end], netloc[end + 1 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise bad(f"{host!r} in brackets is not an IPv6 address") from None
        if after and not after.startswith(":"):
            raise bad(f"unexpected {after!r} after the IPv6 host")
        port_text = after[1:] if after else None
    else:
        if netloc.count(":") > 1:
            raise bad(f"{netloc!r}: bracket an IPv6 host, as in http://[::1]:8000")
        host, colon, port_text_or_empty = netloc.partition(":")
        port_text = port_text_or_empty if colon else None
        if not host:
            raise bad("no host")
        if not _NAME.fullmatch(host) or ":" in port_text_or_empty:
            raise bad(f"host {host!r} is not a name or an address (bracket an IPv6 host)")
        labels = host.removesuffix(".").split(".")
        if any(not 1 <= len(label) <= 63 for label in labels):
            raise bad(f"host {host!r} has an empty label or one over 63 characters")
    if port_text is None:
        port = _DEFAULT_PORT[scheme]
    else:
        if not port_text.isdigit():
            raise bad(f"port {port_text!r} is not a number")
        port = int(port_text)
        if not 1 <= port <= 65535:
            raise bad(f"port {port} is not in 1-65535")
    return EndpointURL(scheme, host, port, parts.path)
