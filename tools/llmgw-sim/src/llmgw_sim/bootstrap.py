"""SGLang's disaggregation bootstrap, as the simulator speaks it (issue 32).

SGLang's load balancer sends one request to a prefill engine and to a decode engine at
once, both with ``bootstrap_host``, ``bootstrap_port`` (the prefill engine's
``--disaggregation-bootstrap-port``) and ``bootstrap_room``; the decode engine asks the
prefill engine's bootstrap server for the room and receives the prompt's KV cache once
the prefill engine has computed it.

Here a prefill engine (``--disaggregation-mode prefill``) announces each room it is given
(:class:`Rooms`) on its bootstrap port (``GET /sim/room/ROOM``: ``{"status": "prefilling"
| "done" | "failed", "prompt_len": N}``, 404 for a room it was never given), marks it
done when its prefill answered and failed when it did not. A decode engine
(``--disaggregation-mode decode``) asks that server (:func:`await_room`) until the room is
done (then the transfer costs ``--sim-kv-transfer-per-token`` per prompt token and only the
last prompt token is computed), and refuses (500, naming the room) a room that failed, that
no prefill engine announced within ``--sim-bootstrap-timeout`` seconds (once announced, it
waits while the prefill runs), or whose prompt length differs from its own.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import OrderedDict

__all__ = ["MAX_ROOMS", "Rooms", "await_room", "room_fields", "serve_bootstrap"]

MAX_ROOMS = 65536  # rooms remembered by a prefill engine (oldest forgotten first)
_PATH = re.compile(rb"^GET /sim/room/(-?\d{1,20}) HTTP/1\.[01]\r?$")


class Rooms:
    """A prefill engine's rooms: status and prompt length, bounded."""

    def __init__(self) -> None:
        self._rooms: OrderedDict[int, tuple[str, int]] = OrderedDict()

    def announce(self, room: int, prompt_len: int) -> None:
        self._rooms[room] = ("prefilling", prompt_len)
        self._rooms.move_to_end(room)
        while len(self._rooms) > MAX_ROOMS:
            self._rooms.popitem(last=False)

    def finish(self, room: int, ok: bool) -> None:
        found = self._rooms.get(room)
        if found is not None:
            self._rooms[room] = ("done" if ok else "failed", found[1])

    def get(self, room: int) -> tuple[str, int] | None:
        return self._rooms.get(room)


def room_fields(body: dict[str, object]) -> tuple[str, int, int] | str | None:
    """(bootstrap_host, bootstrap_port, bootstrap_room) of a request; None when it has
    none of them; a message naming the field when one is missing or wrong."""
    names = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
    if all(body.get(n) is None for n in names):
        return None
    host, port, room = (body.get(n) for n in names)
    if not isinstance(host, str) or not host:
        return "bootstrap_host must be a host name"
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        return "bootstrap_port must be a port number (1-65535)"
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < 2**64:
        return "bootstrap_room must be an integer in 0..2^64-1"
    return host, port, room


async def serve_bootstrap(rooms: Rooms, host: str, port: int) -> asyncio.Server:
    """The prefill engine's bootstrap server: one request per connection."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 10)
            while (await asyncio.wait_for(reader.readline(), 10)).strip():
                pass  # headers
            match = _PATH.match(line.rstrip(b"\n"))
            found = rooms.get(int(match.group(1))) if match else None
            if found is None:
                status, body = b"404 Not Found", b'{"error": "unknown room"}'
            else:
                status = b"200 OK"
                body = json.dumps({"status": found[0], "prompt_len": found[1]}).encode()
            writer.write(
                b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
            )
            await writer.drain()
        except (OSError, TimeoutError, ValueError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)


async def _ask(host: str, port: int, room: int) -> tuple[int, dict[str, object]]:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 2)
    try:
        writer.write(f"GET /sim/room/{room} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body) if status == 200 else {}


async def await_room(
    host: str, port: int, room: int, prompt_len: int, timeout: float, poll: float = 0.01
) -> str | None:
    """Wait for the prefill engine's room to be done: None, or why the KV cannot come."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    where = f"bootstrap room {room} at {host}:{port}"
    last = "no prefill engine announced it"
    while True:
        try:
            status, answer = await _ask(host, port, room)
        except (OSError, TimeoutError, ValueError, IndexError) as err:
            status, answer = 0, {}
            last = f"its bootstrap server did not answer ({type(err).__name__})"
        if status == 200:
            state = answer.get("status")
            if answer.get("prompt_len") != prompt_len:
                return (
                    f"KV transfer failed: {where} holds a {answer.get('prompt_len')}-token "
                    f"prompt, this request has {prompt_len}"
                )
            if state == "done":
                return None
            if state == "failed":
                return f"KV transfer failed: the prefill of {where} failed"
            last = "its prefill did not finish"
            deadline = max(deadline, loop.time() + timeout)  # announced: its prefill may take long
        elif status == 404:
            last = "no prefill engine announced it"
        if loop.time() >= deadline:
            return f"KV transfer failed: {where}: {last} within {timeout:g}s"
        await asyncio.sleep(poll)
