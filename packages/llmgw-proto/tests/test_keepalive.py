"""Issue 24 point 11: pings that find a frozen peer, every interval, not once.

A real grpclib server in a child process serves a stream; once pings have been
answered for a while, the child is frozen (SIGSTOP) with its connection open. The
client's stream must fail within ``interval + timeout`` (plus slack): grpclib's
defaults sent one ping and then none for 300 s, so the stream hung on.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import grpclib.client
import pytest
from grpclib.health.v1.health_grpc import HealthStub
from grpclib.health.v1.health_pb2 import HealthCheckRequest
from hypothesis import given
from hypothesis import strategies as st
from llmgw_proto.keepalive import MIN_SECONDS, keepalive, keepalive_problem
from llmgw_testkit import Proc, free_port, wait_for

SERVER = """
import asyncio, sys
from grpclib.server import Server
from grpclib.health.service import Health

async def main():
    server = Server([Health()])
    await server.start("127.0.0.1", int(sys.argv[1]))
    print("serving", flush=True)
    await server.wait_closed()

asyncio.run(main())
"""


@given(st.floats(allow_nan=True), st.floats(allow_nan=True))
def test_keepalive_problem_names_the_field(interval: float, timeout: float) -> None:
    problem = keepalive_problem(interval, timeout)
    if interval >= MIN_SECONDS and timeout >= MIN_SECONDS:
        assert problem is None
        config = keepalive(interval, timeout)
        assert config._keepalive_time == interval
        assert config._keepalive_timeout == timeout
        assert config._http2_max_pings_without_data == 0
        assert config._http2_min_sent_ping_interval_without_data <= interval
    else:
        assert problem is not None
        assert problem[0] == ("keepalive" if not interval >= MIN_SECONDS else "keepalive_timeout")
        assert "must be >= 10ms" in problem[1]


async def test_a_frozen_peer_ends_the_stream(tmp_path: Path) -> None:
    port = free_port()
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    with Proc([sys.executable, str(script), str(port)], log_dir=tmp_path, name="server") as proc:
        wait_for(lambda: "serving" in proc.tail(), timeout=30, what="the server up")
        interval, timeout = 0.2, 0.6
        channel = grpclib.client.Channel("127.0.0.1", port, config=keepalive(interval, timeout))
        try:
            async with HealthStub(channel).Watch.open() as stream:
                await stream.send_message(HealthCheckRequest(), end=True)
                assert await stream.recv_message() is not None
                # Several pings answered (grpclib's defaults stop after the first)...
                await asyncio.sleep(5 * interval)
                proc.signal(signal.SIGSTOP)
                try:
                    frozen_at = time.monotonic()
                    # ...then none: the connection is given up and the stream ends.
                    with pytest.raises(Exception) as err:
                        async with asyncio.timeout(30):
                            await stream.recv_message()
                    assert not isinstance(err.value, TimeoutError), (
                        f"the stream to a frozen peer was still open after "
                        f"{time.monotonic() - frozen_at:.1f}s"
                    )
                finally:
                    proc.signal(signal.SIGCONT)
        finally:
            channel.close()
