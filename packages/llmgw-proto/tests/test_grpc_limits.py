"""The message bound on gRPC streams: the prefix rule, and over real loopback gRPC."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from typing import Any

import grpclib.const
import grpclib.server
import pytest
from grpclib.exceptions import GRPCError
from hypothesis import given
from hypothesis import strategies as st
from llmgw_proto import v1
from llmgw_proto.grpc_limits import (
    DEFAULT_MAX_MESSAGE,
    PREFIX,
    BoundedChannel,
    announced_length,
    bound_handlers,
    too_large,
)

METHOD = "/llmgw.v1.EndpointService/ReportDemand"
KiB = 1024


def prefix(length: int, compressed: bool = False) -> bytes:
    return struct.pack("?", compressed) + struct.pack(">I", length)


@given(st.integers(min_value=0, max_value=2**32 - 1), st.booleans())
def test_the_prefix_announces_its_length(length: int, compressed: bool) -> None:
    assert announced_length(prefix(length, compressed)) == length


@given(st.integers(min_value=0, max_value=2**32 - 1), st.integers(min_value=0, max_value=2**32))
def test_too_large_exactly_when_over_the_limit(length: int, limit: int) -> None:
    got = too_large(prefix(length), limit)
    assert (got is not None) == (length > limit)
    if got is not None:
        assert got == length


@given(st.binary().filter(lambda b: len(b) != PREFIX))
def test_anything_but_five_bytes_is_not_a_prefix(data: bytes) -> None:
    with pytest.raises(ValueError, match="5 bytes"):
        announced_length(data)


def test_the_default_is_grpcs_four_mebibytes() -> None:
    assert DEFAULT_MAX_MESSAGE == 4 * 1024 * 1024


class Echo:
    """ReportDemand answering with a reason as long as the model name it got."""

    def __init__(self) -> None:
        self.received: list[int] = []

    async def handle(self, stream: grpclib.server.Stream[v1.DemandRequest, v1.DemandReply]) -> None:
        request = await stream.recv_message()
        assert request is not None
        self.received.append(len(request.model))
        await stream.send_message(v1.DemandReply(accepted=True, reason="r" * len(request.model)))

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            METHOD: grpclib.const.Handler(
                self.handle,
                grpclib.const.Cardinality.UNARY_UNARY,
                v1.DemandRequest,
                v1.DemandReply,
            )
        }


class Bounded(grpclib.server.Server):
    def __init__(self, handlers: list[Any], limit: int, refused: list[tuple[Any, ...]]) -> None:
        super().__init__(handlers)
        self._mapping = bound_handlers(self._mapping, limit, lambda *args: refused.append(args))


@pytest.fixture
async def served() -> AsyncIterator[tuple[int, Echo, list[tuple[Any, ...]]]]:
    echo = Echo()
    refused: list[tuple[Any, ...]] = []
    server = Bounded([echo], 64 * KiB, refused)
    await server.start("127.0.0.1", 0)
    assert isinstance(server._server, asyncio.Server)
    port = server._server.sockets[0].getsockname()[1]
    try:
        yield port, echo, refused
    finally:
        server.close()
        await server.wait_closed()


async def call(port: int, model: str, client_limit: int = DEFAULT_MAX_MESSAGE) -> v1.DemandReply:
    refused: list[tuple[Any, ...]] = []
    channel = BoundedChannel(
        "127.0.0.1", port, max_message=client_limit, on_refused=lambda *a: refused.append(a)
    )
    try:
        async with channel.request(
            METHOD, grpclib.const.Cardinality.UNARY_UNARY, v1.DemandRequest, v1.DemandReply
        ) as stream:
            await stream.send_message(v1.DemandRequest(model=model), end=True)
            reply = await stream.recv_message()
            assert isinstance(reply, v1.DemandReply)
            return reply
    except GRPCError:
        if refused:
            method, _, who, length, limit = refused[0]
            assert method == METHOD
            assert who == "unauthenticated"
            assert length > limit == client_limit
        raise
    finally:
        channel.close()


async def test_a_message_over_the_servers_bound_is_refused_unread(
    served: tuple[int, Echo, list[tuple[Any, ...]]],
) -> None:
    port, echo, refused = served
    reply = await call(port, "m" * (60 * KiB))
    assert reply.accepted
    with pytest.raises(GRPCError) as err:
        await call(port, "m" * (1024 * KiB))
    assert err.value.status == grpclib.const.Status.RESOURCE_EXHAUSTED
    assert "larger than the limit of 65536 bytes" in str(err.value.message)
    assert echo.received == [60 * KiB], "the handler never saw the large one"
    assert len(refused) == 1
    method, peer, who, length, limit = refused[0]
    assert (method, who, limit) == (METHOD, "unauthenticated", 64 * KiB)
    assert peer.startswith("127.0.0.1:")
    assert length > 1024 * KiB
    # The connection's other calls go on.
    assert (await call(port, "m")).accepted


async def test_a_client_refuses_a_reply_over_its_bound(
    served: tuple[int, Echo, list[tuple[Any, ...]]],
) -> None:
    port, _, _ = served
    assert (await call(port, "m" * (10 * KiB), client_limit=64 * KiB)).accepted
    with pytest.raises(GRPCError) as err:
        await call(port, "m" * (40 * KiB), client_limit=16 * KiB)
    assert err.value.status == grpclib.const.Status.RESOURCE_EXHAUSTED
