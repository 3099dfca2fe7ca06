"""GET /v1/logs/REPLICA on a real admin socket, the agent's side scripted on its session:
the request, chunks to the client, one credit back per chunk, a cancel when it goes."""

from __future__ import annotations

import asyncio
import json

import msgspec
from llmgw_control.admin import AdminServer
from llmgw_control.agent_service import Session
from llmgw_control.config import ControlConfig, Loaded, check
from llmgw_control.controller import Controller
from llmgw_control.logs import LogRelay, LogsQuery, parse_query
from llmgw_control.records import Replica, ShardPlan
from llmgw_proto import v1


def controller() -> tuple[Controller, Session]:
    config = msgspec.convert(
        {
            "tls": {"insecure": True},
            "models": [{"name": "m", "profiles": {"p": {"engine": "vllm", "replicas": 1}}}],
        },
        ControlConfig,
    )
    c = Controller(Loaded(config, check(config, "control.yaml")))
    replica = Replica("m.p.1", "m", "p")
    replica.shards = [ShardPlan("m.p.1-0", "n1", 0, (0,), 20000, "127.0.0.1")]
    c.state.replicas[replica.replica_id] = replica
    session = Session("n1", "s1", "127.0.0.1")
    c.agents.sessions["n1"] = session
    return c, session


async def start(c: Controller) -> tuple[AdminServer, int]:
    admin = AdminServer(c, c.metrics.registry)
    admin.streamers.append(LogRelay(c).serve)
    await admin.start("127.0.0.1", 0)
    assert admin._server is not None
    return admin, int(admin._server.sockets[0].getsockname()[1])


async def get(port: int, target: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    return reader, writer


async def next_message(session: Session) -> v1.ControlMessage:
    return await asyncio.wait_for(session.outbox.get(), 10)


async def test_follow_relays_chunks_gives_credit_and_cancels() -> None:
    c, session = controller()
    admin, port = await start(c)
    relay_chunk = c.agents.on_logs_chunk
    try:
        reader, writer = await get(port, "/v1/logs/m.p.1?tail=2&follow=1")
        asked = (await next_message(session)).logs_request
        assert asked is not None
        assert (asked.shard_id, asked.tail, asked.follow, asked.credit) == ("m.p.1-0", 2, True, 4)
        sid = asked.subscription_id
        relay_chunk(session, v1.LogsChunk(subscription_id=sid, lines=["one", "two"]))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200 OK")
        assert await asyncio.wait_for(reader.readline(), 10) == b"one\n"
        assert await asyncio.wait_for(reader.readline(), 10) == b"two\n"
        credit = (await next_message(session)).logs_credit
        assert credit is not None
        assert (credit.subscription_id, credit.chunks) == (sid, 1)
        # A chunk from another stream (or for another reader) is not this reader's.
        relay_chunk(Session("n1", "old", ""), v1.LogsChunk(subscription_id=sid, lines=["x"]))
        relay_chunk(session, v1.LogsChunk(subscription_id=sid, lines=["three"]))
        assert await asyncio.wait_for(reader.readline(), 10) == b"three\n"
        assert (await next_message(session)).logs_credit is not None
        writer.close()  # the reader goes: the agent is told to stop
        cancel = (await next_message(session)).logs_cancel
        assert cancel is not None
        assert cancel.subscription_id == sid
    finally:
        await admin.close()


async def test_refusals_are_json_with_what_is_wrong() -> None:
    c, session = controller()
    admin, port = await start(c)
    try:
        for target, status, words in [
            ("/v1/logs/nope", 404, "no replica 'nope'"),
            ("/v1/logs/m.p.1?shard=3", 404, "has no shard 3 (shards: 0)"),
            ("/v1/logs/m.p.1?tail=x", 400, "tail='x': a whole number from 0 to 10000"),
            ("/v1/logs/m.p.1?colour=1", 400, "unknown query parameter 'colour'"),
        ]:
            reader, writer = await get(port, target)
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(f"HTTP/1.1 {status}".encode()), target
            assert words in json.loads(body)["error"], target
        # The agent says the shard does not run there: a 404 with its words.
        reader, writer = await get(port, "/v1/logs/m.p.1")
        asked = (await next_message(session)).logs_request
        assert asked is not None
        c.agents.on_logs_chunk(
            session,
            v1.LogsChunk(subscription_id=asked.subscription_id, end=True, error="not here"),
        )
        answer = await asyncio.wait_for(reader.read(), 10)
        assert answer.startswith(b"HTTP/1.1 404")
        assert json.loads(answer.partition(b"\r\n\r\n")[2]) == {"error": "not here"}
    finally:
        await admin.close()


def test_parse_query() -> None:
    assert parse_query("/v1/logs/r") == LogsQuery("r")
    assert parse_query("/v1/logs/r?follow=true&tail=0&shard=1") == LogsQuery("r", 1, 0, True)
    assert isinstance(parse_query("/v1/logs/"), str)
    assert isinstance(parse_query("/v1/logs/r?tail=10001"), str)
