"""Engine logs on request (llmgw_agent.logs): chunks bounded, credit-paced, masked, ended."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from llmgw_agent.logs import MAX_SUBSCRIPTIONS, LogSubscriptions, chunks
from llmgw_agent.output import OutputFollower, poll_lines
from llmgw_proto import v1


@given(st.lists(st.text(max_size=300), max_size=60), st.integers(1, 10), st.integers(8, 400))
def test_chunks_are_bounded_and_keep_every_line(lines: list[str], most: int, size: int) -> None:
    out = chunks(lines, most, size)
    assert sum(len(c) for c in out) == len(lines)
    for line, kept in zip([x for c in out for x in c], lines, strict=True):
        assert line == kept or (len(kept.encode()) > size and line.endswith("..."))
    for c in out:
        assert c
        assert len(c) <= most
        assert sum(len(x.encode()) + 1 for x in c) <= size + 1 or len(c) == 1


async def until(cond: object, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def request(sid: str, *, tail: int = 0, follow: bool = False, credit: int = 1) -> v1.ControlMessage:
    return v1.ControlMessage(
        logs_request=v1.LogsRequest(
            subscription_id=sid, shard_id="s-0", tail=tail, follow=follow, credit=credit
        )
    )


def setup(tmp_path: Path) -> tuple[Path, LogSubscriptions, list[v1.LogsChunk]]:
    path = tmp_path / "engine.log"
    path.write_text('one\ntwo key=SECRET\nINFO: 1.2.3.4 - "GET /health HTTP/1.1" 200 OK\nthree\n')
    follower = OutputFollower(
        path, "s-0", lines=10, max_bytes=1 << 20, skip=poll_lines(["/health"]), secret="SECRET"
    )
    sent: list[v1.LogsChunk] = []

    def send(message: v1.AgentMessage) -> None:
        assert message.logs_chunk is not None
        sent.append(message.logs_chunk)

    subs = LogSubscriptions(lambda shard: follower if shard == "s-0" else None, send, poll=0.01)
    return path, subs, sent


async def test_tail_then_end_masked_and_without_polls(tmp_path: Path) -> None:
    _, subs, sent = setup(tmp_path)
    assert subs.handle(request("a", tail=10, credit=4))
    await until(lambda: sent and sent[-1].end, "the end")
    assert [line for c in sent for line in c.lines] == ["one", "two key=***", "three"]
    assert sent[-1].error == ""
    assert subs.subscriptions == {}


async def test_follow_waits_for_credit_and_stops_on_cancel(tmp_path: Path) -> None:
    path, subs, sent = setup(tmp_path)
    subs.handle(request("a", follow=True, credit=1))
    with path.open("a") as f:
        f.write("four\n")
    await until(lambda: len(sent) == 1, "the first chunk")
    assert sent[0].lines == ["four"]
    with path.open("a") as f:
        f.write("five\n")
    await asyncio.sleep(0.1)  # several polls: no credit, so nothing more is sent
    assert len(sent) == 1
    assert subs.handle(v1.ControlMessage(logs_credit=v1.LogsCredit(subscription_id="a", chunks=1)))
    await until(lambda: len(sent) == 2, "the chunk the credit allows")
    assert sent[1].lines == ["five"]
    assert subs.handle(v1.ControlMessage(logs_cancel=v1.LogsCancel(subscription_id="a")))
    assert subs.subscriptions == {}


async def test_unknown_shard_too_many_readers_and_a_new_stream(tmp_path: Path) -> None:
    _, subs, sent = setup(tmp_path)
    subs.handle(
        v1.ControlMessage(
            logs_request=v1.LogsRequest(subscription_id="x", shard_id="nope", credit=1)
        )
    )
    await until(lambda: sent, "an answer")
    assert sent[0].end
    assert "does not run on this node" in sent[0].error
    for i in range(MAX_SUBSCRIPTIONS):
        subs.handle(request(f"f{i}", follow=True))
    subs.handle(request("one-too-many", follow=True))
    assert sent[-1].subscription_id == "one-too-many"
    assert "too many log readers" in sent[-1].error
    subs.reset()
    assert subs.subscriptions == {}
    assert not subs.handle(v1.ControlMessage(stop_shard=v1.StopShard(shard_id="s-0")))
