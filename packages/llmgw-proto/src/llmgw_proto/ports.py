"""A port already in use, said once and clearly: which setting, which address, and
the process that holds it where it can be found.

Each program checks the addresses it is about to listen on before it starts anything
(:func:`first_taken`), so the answer is the same whatever server and worker mode
follows (the router's own server, uvicorn, worker processes):

    error: listen 127.0.0.1:8080 is already in use (by pid 4242: python3 -m http.server
    8080); choose another port in the config, or stop that process

The holder comes from /proc (Linux): the listening socket's inode in /proc/net/tcp{,6},
then the process with that socket among its open files; only processes the caller may
look into are found (root: all). :func:`listeners` is the pure parsing.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Iterable, Mapping
from pathlib import Path

from llmgw_proto.addr import parse_hostport

__all__ = ["first_taken", "holder_of", "listeners", "taken_message"]

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


def listeners(table: str) -> list[tuple[int, int]]:
    """(port, socket inode) of each listening socket in a /proc/net/tcp{,6} text."""
    out = []
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or fields[3] != _LISTEN:
            continue
        _, _, port_hex = fields[1].rpartition(":")
        try:
            out.append((int(port_hex, 16), int(fields[9])))
        except ValueError:
            continue
    return out


def _cmdline(pid: str, proc: Path) -> str:
    with contextlib.suppress(OSError):
        raw = (proc / pid / "cmdline").read_bytes().replace(b"\0", b" ")
        # One line of visible text: a command line may hold newlines or escapes.
        text = " ".join(raw.decode(errors="replace").split())
        text = "".join(c if c.isprintable() else "?" for c in text)
        if text:
            return text if len(text) <= 160 else text[:159] + "…"
    with contextlib.suppress(OSError):
        return (proc / pid / "comm").read_text().strip()
    return "?"


def holder_of(port: int, proc: Path = Path("/proc")) -> str | None:
    """``pid N: command line`` of a process listening on TCP ``port``; None if not found."""
    inodes: set[int] = set()
    for name in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            inodes.update(i for p, i in listeners((proc / "net" / name).read_text()) if p == port)
    inodes.discard(0)
    if not inodes:
        return None
    wanted = {f"socket:[{i}]" for i in inodes}
    with contextlib.suppress(OSError):
        for entry in proc.iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                for fd in (entry / "fd").iterdir():
                    with contextlib.suppress(OSError):
                        if os.readlink(fd) in wanted:
                            return f"pid {entry.name}: {_cmdline(entry.name, proc)}"
    return None


def _in_use(host: str, port: int) -> bool:
    """Whether a server could not listen on ``host:port`` now (as asyncio's would, with
    SO_REUSEADDR: a port in TIME_WAIT is free, one with a listener is not)."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError:
        return False  # a name that does not resolve: the server says so itself
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(address)
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    return True
    return False


def taken_message(setting: str, address: str, holder: str | None) -> str:
    by = (
        f" (by {holder})" if holder else " (by a process this user cannot see: `ss -ltnp` names it)"
    )
    return (
        f"{setting} {address} is already in use{by}; choose another port in the config, "
        "or stop that process"
    )


def first_taken(addresses: Mapping[str, str] | Iterable[tuple[str, str]]) -> str | None:
    """The message for the first of (setting, host:port) already in use; None when all free.

    Port 0 (any free port) and unparsable addresses are skipped: the config check says
    what is wrong with those.
    """
    pairs = addresses.items() if isinstance(addresses, Mapping) else addresses
    for setting, address in pairs:
        try:
            host, port = parse_hostport(address, allow_port_zero=True)
        except ValueError:
            continue
        if port and _in_use(host, port):
            return taken_message(setting, address, holder_of(port))
    return None
