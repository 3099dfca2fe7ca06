"""SGLang's bootstrap rooms (llmgw_sim.bootstrap): the request fields judged, the rooms a
prefill engine keeps, and a decode engine's wait against a real bootstrap server."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from llmgw_sim.bootstrap import MAX_ROOMS, Rooms, await_room, room_fields, serve_bootstrap
from llmgw_testkit import free_port

values = st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.floats()


@given(host=values, port=values, room=values)
def test_room_fields_are_taken_or_named(host: Any, port: Any, room: Any) -> None:
    body = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}
    got = room_fields(body)
    if host is None and port is None and room is None:
        assert got is None
    elif isinstance(got, tuple):
        assert got == (host, port, room)
        assert isinstance(host, str)
        assert 0 < port < 65536
        assert 0 <= room < 2**64
    else:
        assert isinstance(got, str)
        assert got.split(" ")[0] in {"bootstrap_host", "bootstrap_port", "bootstrap_room"}


def test_rooms_are_bounded_and_finish_only_announced_ones() -> None:
    rooms = Rooms()
    for room in range(MAX_ROOMS + 5):
        rooms.announce(room, 7)
    assert rooms.get(0) is None
    assert rooms.get(MAX_ROOMS + 4) == ("prefilling", 7)
    rooms.finish(MAX_ROOMS + 4, True)
    assert rooms.get(MAX_ROOMS + 4) == ("done", 7)
    rooms.finish(1, False)  # forgotten: nothing to mark
    assert rooms.get(1) is None


def test_a_decode_waits_for_the_room_and_refuses_the_rest() -> None:
    async def scenario() -> None:
        rooms = Rooms()
        port = free_port()
        server = await serve_bootstrap(rooms, "127.0.0.1", port)
        try:
            # Announced after the decode started asking, then done: taken.
            waiting = asyncio.create_task(await_room("127.0.0.1", port, 5, 12, 5.0))
            await asyncio.sleep(0)
            rooms.announce(5, 12)
            rooms.finish(5, True)
            assert await waiting is None
            # Failed, another prompt length, never announced: refused, naming the room.
            rooms.announce(6, 12)
            rooms.finish(6, False)
            why = await await_room("127.0.0.1", port, 6, 12, 5.0)
            assert why is not None
            assert "bootstrap room 6" in why
            assert "failed" in why
            why = await await_room("127.0.0.1", port, 5, 13, 5.0)
            assert why is not None
            assert "12-token prompt" in why
            why = await await_room("127.0.0.1", port, 99, 12, 0.2)
            assert why is not None
            assert "no prefill engine announced it" in why
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(scenario())
