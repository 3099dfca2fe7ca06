"""Issue 13.5: malformed gRPC frames on the agent stream, sent with a raw HTTP/2 client.

Each is logged by the control plane as one warning line naming the peer and the reason
(no traceback, nothing at error level), and the stream ends with INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import Callable
from typing import Any

import h2.config
import h2.connection
import h2.events
import pytest

CONNECT = "/llmgw.v1.AgentService/Connect"


def grpc_exchange(port: int, path: str, payload: bytes) -> tuple[dict[str, str], int]:
    """Send one request with ``payload`` as its body; the response's trailers and our port."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    local_port = sock.getsockname()[1]
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    sid = conn.get_next_available_stream_id()
    conn.send_headers(
        sid,
        [
            (":method", "POST"), (":scheme", "http"), (":path", path),
            (":authority", f"127.0.0.1:{port}"), ("content-type", "application/grpc"),
            ("te", "trailers"),
        ],
    )  # fmt: skip
    conn.send_data(sid, payload, end_stream=True)
    sock.sendall(conn.data_to_send())
    headers: dict[str, str] = {}
    try:
        while True:
            data = sock.recv(65535)
            if not data:
                break
            ended = False
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    headers.update(
                        {
                            (k.decode() if isinstance(k, bytes) else k): (
                                v.decode() if isinstance(v, bytes) else v
                            )
                            for k, v in event.headers
                        }
                    )
                if isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                    ended = True
            sock.sendall(conn.data_to_send())
            if ended:
                break
    finally:
        sock.close()
    return headers, local_port


CASES = {
    "compressed flag": (b"\x01" + struct.pack(">I", 3) + b"abc", "Compression not implemented"),
    "cut short": (b"\x00" + struct.pack(">I", 100) + b"abc", "Received less data than expected"),
    "torn prefix": (b"\x00\x00", "Received less data than expected"),
}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_malformed_frame_is_one_warning_with_peer_and_reason(
    control_factory: Callable[..., Any], case: str
) -> None:
    payload, reason = CASES[case]
    control = control_factory([])
    headers, local_port = await asyncio.to_thread(
        grpc_exchange, control.grpc_port, CONNECT, payload
    )
    assert headers.get("grpc-status") == "3", headers  # INVALID_ARGUMENT
    assert reason in headers.get("grpc-message", ""), headers
    control.proc.wait_output("malformed gRPC message", timeout=20)
    output = control.proc.output()
    assert "Traceback" not in output
    records = [json.loads(x) for x in output.splitlines() if x.startswith("{")]
    (warning,) = [r for r in records if r.get("event") == "malformed gRPC message"]
    assert warning["level"] == "warning"
    assert warning["peer"] == f"127.0.0.1:{local_port}"
    assert reason in warning["reason"]
    assert warning["stream"] == "agent stream"
    assert not [r for r in records if r.get("level") in ("error", "critical")], records
