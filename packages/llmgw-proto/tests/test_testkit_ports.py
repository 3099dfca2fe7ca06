"""The test kit's ports (llmgw_testkit.free_port, engine_port_range): from ranges of their
own below the kernel's ephemeral ports, so a port handed to a program is never the source
port of a client connection, and each pytest-xdist worker from its own slice."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from llmgw_testkit import ENGINE_PORTS, PROGRAM_PORTS, free_port, worker_slice


def _ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


@pytest.mark.skipif(_ephemeral_low() < PROGRAM_PORTS[1], reason="ephemeral ports reach down")
def test_free_ports_are_below_the_ephemeral_range_free_and_not_repeated() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == 200
    low, high = worker_slice(*PROGRAM_PORTS)
    for port in ports:
        assert low <= port < high
        # Free: a listener can take it (as the program it is for will).
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
    # An outgoing connection's source port comes from the ephemeral range: never one of these.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname()) as client:
            assert client.getsockname()[1] >= PROGRAM_PORTS[1]


@pytest.mark.skipif(_ephemeral_low() < PROGRAM_PORTS[1], reason="ephemeral ports reach down")
def test_a_taken_port_is_skipped() -> None:
    taken = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        # The slice wraps round to the taken port within its width; it is passed over.
        low, high = worker_slice(*PROGRAM_PORTS)
        handed = {free_port() for _ in range(high - low)}
    assert taken not in handed


@given(st.integers(2, 8), st.data())
def test_xdist_workers_never_share_a_port(workers: int, data: st.DataObject) -> None:
    a = data.draw(st.integers(0, workers - 1))
    b = data.draw(st.integers(0, workers - 1).filter(lambda w: w != a))
    for bounds in (PROGRAM_PORTS, ENGINE_PORTS):
        lo_a, hi_a = worker_slice(*bounds, worker=f"gw{a}", workers=workers)
        lo_b, hi_b = worker_slice(*bounds, worker=f"gw{b}", workers=workers)
        assert bounds[0] <= lo_a < hi_a <= bounds[1]
        assert hi_a <= lo_b or hi_b <= lo_a


def test_outside_xdist_the_whole_range() -> None:
    assert worker_slice(*PROGRAM_PORTS, worker="", workers=1) == PROGRAM_PORTS
