"""llmgw_proto.ports: listening sockets from /proc/net/tcp{,6}, and the message."""

from __future__ import annotations

import socket

from hypothesis import given
from hypothesis import strategies as st
from llmgw_proto.ports import first_taken, holder_of, listeners, taken_message

rows = st.lists(
    st.tuples(
        st.booleans(),  # IPv6
        st.integers(0, 65535),
        st.sampled_from(["0A", "01", "06", "08"]),
        st.integers(0, 2**31),
    ),
    max_size=20,
)


@given(rows)
def test_listeners_are_the_rows_in_listen_state(entries: list[tuple[bool, int, str, int]]) -> None:
    lines = [
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode"
    ]
    for i, (v6, port, state, inode) in enumerate(entries):
        host = "0" * 32 if v6 else "0100007F"
        lines.append(
            f"{i:4}: {host}:{port:04X} {host}:0000 {state} 00000000:00000000 00:00000000 "
            f"00000000  1000        0 {inode} 1 0000000000000000 100 0 0 10 0"
        )
    assert listeners("\n".join(lines)) == [(p, i) for _, p, s, i in entries if s == "0A"]


def test_a_port_held_here_is_found_and_named() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        message = first_taken({"listen": f"127.0.0.1:{port}", "other": "127.0.0.1:0"})
        assert message is not None
        assert message.startswith(f"listen 127.0.0.1:{port} is already in use")
    # This process is not named as the holder of its own port: another process is asked for.
    assert holder_of(port) is None
    assert first_taken({"listen": f"127.0.0.1:{port}"}) is None
    assert first_taken({"listen": "not an address"}) is None


def test_message_without_a_holder_says_how_to_find_it() -> None:
    assert "ss -ltnp" in taken_message("listen", "0.0.0.0:80", None)
