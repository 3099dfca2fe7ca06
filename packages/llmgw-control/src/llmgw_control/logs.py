"""Engine logs through the control plane: ``GET /v1/logs/REPLICA?shard=N&tail=N&follow=1``.

The admin API asks the agent of the replica's shard for its engine's output over the
agent's stream (a LogsRequest with a subscription id, the tail count, follow, and
:data:`CREDIT` chunks of credit) and writes the chunks that come back to the HTTP
client as plain text, a line per line, until the agent says the end, the client goes,
or the node's stream ends. Each chunk written (and drained to the client's socket)
gives the agent one more chunk of credit: a slow reader slows the agent's chunks, and
nothing else on the stream waits for it. The answer's first line is only sent once the
agent answered; an error after that is written as a line ``#error WHY``.

The status page (and any client) can read the same URL; ``llmgw-control logs`` prints it.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import urllib.parse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import structlog
from llmgw_proto import v1

from llmgw_control.agent_service import Session

if TYPE_CHECKING:
    from llmgw_control.controller import Controller

__all__ = ["CREDIT", "LogRelay", "LogsQuery", "parse_query"]

log = structlog.get_logger(__name__)

PREFIX = "/v1/logs/"
# Chunks the agent may send ahead of the reader (each at most 32 KiB).
CREDIT = 4
# Readers at once over the whole control plane.
MAX_READERS = 32
# How long the agent has to answer a request with its first chunk.
FIRST_WITHIN = 15.0
# How often a quiet follow checks that the node's stream still stands.
CHECK_EVERY = 2.0


@dataclass(frozen=True)
class LogsQuery:
    replica_id: str
    shard: int = 0
    tail: int = 100
    follow: bool = False


def parse_query(target: str) -> LogsQuery | str:
    """The request's replica, shard rank, tail and follow; or what is wrong with it. Pure."""
    split = urllib.parse.urlsplit(target)
    replica = urllib.parse.unquote(split.path.removeprefix(PREFIX))
    if not replica or "/" in replica:
        return "give a replica id: /v1/logs/REPLICA?shard=N&tail=N&follow=1"
    values: dict[str, int] = {"shard": 0, "tail": 100, "follow": 0}
    bounds = {"shard": 1024, "tail": 10_000, "follow": 1}
    for name, got in urllib.parse.parse_qsl(split.query, keep_blank_values=True):
        if name not in values:
            return f"unknown query parameter {name[:40]!r}: shard, tail or follow"
        text = got.strip().lower()
        if name == "follow" and text in ("true", "yes"):
            text = "1"
        if name == "follow" and text in ("false", "no", ""):
            text = "0"
        if not text.isdigit() or int(text) > bounds[name]:
            return f"{name}={got[:40]!r}: a whole number from 0 to {bounds[name]}"
        values[name] = int(text)
    return LogsQuery(replica, values["shard"], values["tail"], bool(values["follow"]))


@dataclass(frozen=True)
class Refused:
    status: int
    why: str


@dataclass(eq=False)
class _Reader:
    node_id: str
    session_id: str
    chunks: asyncio.Queue[v1.LogsChunk] = field(default_factory=asyncio.Queue)


class LogRelay:
    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self.readers: dict[str, _Reader] = {}
        controller.agents.on_logs_chunk = self.on_chunk

    def on_chunk(self, session: Session, chunk: v1.LogsChunk) -> None:
        reader = self.readers.get(chunk.subscription_id)
        # Only from the node asked, on the stream asked: never more than its credit.
        if reader is not None and reader.session_id == session.session_id:
            reader.chunks.put_nowait(chunk)

    async def serve(
        self, target: str, client: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """The admin API's streaming route (admin.Streamer)."""
        if not urllib.parse.urlsplit(target).path.startswith(PREFIX):
            return False
        query = parse_query(target)
        if isinstance(query, str):
            await _answer(writer, 400, query)
            return True
        found = self._where(query)
        if isinstance(found, Refused):
            await _answer(writer, found.status, found.why)
            return True
        node_id, shard_id = found
        sid = secrets.token_hex(8)
        request = v1.LogsRequest(
            subscription_id=sid,
            shard_id=shard_id,
            tail=query.tail,
            follow=query.follow,
            credit=CREDIT,
        )
        session = self.controller.agents.post(node_id, v1.ControlMessage(logs_request=request))
        if session is None:
            await _answer(writer, 503, f"node {node_id} has no stream to the control plane now")
            return True
        reader = _Reader(node_id, session.session_id)
        self.readers[sid] = reader
        log.info("engine logs", replica_id=query.replica_id, shard_id=shard_id,
                 node_id=node_id, follow=query.follow, tail=query.tail)  # fmt: skip
        try:
            await self._relay(reader, session, sid, client, writer)
        finally:
            self.readers.pop(sid, None)
            cancel = v1.ControlMessage(logs_cancel=v1.LogsCancel(subscription_id=sid))
            if self.controller.agents.sessions.get(node_id) is session:
                session.outbox.put_nowait(cancel)
        return True

    def _where(self, q: LogsQuery) -> tuple[str, str] | Refused:
        """(node, shard id) of the asked shard, or (HTTP status, why not)."""
        if len(self.readers) >= MAX_READERS:
            return Refused(503, f"too many log readers (at most {MAX_READERS}); try again later")
        replica = self.controller.state.replicas.get(q.replica_id)
        if replica is None:
            return Refused(
                404, f"no replica {q.replica_id[:200]!r}: `llmgw-control status` lists them"
            )
        plan = next((p for p in replica.shards if p.rank == q.shard), None)
        if plan is None:
            ranks = ", ".join(str(p.rank) for p in replica.shards) or "none: it is not placed"
            return Refused(404, f"replica {q.replica_id} has no shard {q.shard} (shards: {ranks})")
        return plan.node_id, plan.shard_id

    async def _relay(
        self,
        reader: _Reader,
        session: Session,
        sid: str,
        client: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        gone = asyncio.ensure_future(client.read(1))  # b"" once the client hangs up
        started = False
        try:
            while True:
                got = asyncio.ensure_future(reader.chunks.get())
                done, _ = await asyncio.wait(
                    {got, gone},
                    timeout=CHECK_EVERY if started else FIRST_WITHIN,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if self.controller.agents.sessions.get(reader.node_id) is not session:
                    got.cancel()
                    break
                if got not in done:
                    got.cancel()
                    if gone in done:
                        return  # the client hung up
                    if started:
                        continue  # following a quiet engine
                    await _answer(writer, 504, f"node {reader.node_id} did not answer")
                    return
                chunk = got.result()
                if not started and chunk.end and chunk.error:
                    await _answer(writer, 404, chunk.error)
                    return
                if not started:
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\n"
                        b"Cache-Control: no-store\r\nConnection: close\r\n\r\n"
                    )
                    started = True
                text = "".join(line + "\n" for line in chunk.lines)
                if chunk.error:
                    text += f"#error {chunk.error}\n"
                writer.write(text.encode())
                await writer.drain()
                if chunk.end:
                    return
                credit = v1.LogsCredit(subscription_id=sid, chunks=1)
                session.outbox.put_nowait(v1.ControlMessage(logs_credit=credit))
            if started:
                writer.write(f"#error node {reader.node_id}'s stream ended\n".encode())
                await writer.drain()
            else:
                await _answer(writer, 503, f"node {reader.node_id}'s stream ended")
        finally:
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await gone


async def _answer(writer: asyncio.StreamWriter, status: int, why: str) -> None:
    body = msgspec.json.encode({"error": why})
    reasons = {400: "Bad Request", 404: "Not Found", 503: "Service Unavailable", 504: "Timeout"}
    writer.write(
        f"HTTP/1.1 {status} {reasons.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    with contextlib.suppress(OSError):
        await writer.drain()
