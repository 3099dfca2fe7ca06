"""Which engine output lines are the agent's own polls (left out of tails and the log)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from llmgw_agent.output import OutputFollower, file_tail, poll_lines

polls = poll_lines(["/health", "/metrics"])

# As the engines write them (vLLM 0.32 on the CPU, SGLang 0.5, llama-server b6xxx).
POLL_LINES = [
    'INFO:     127.0.0.1:59498 - "GET /health HTTP/1.1" 200 OK',
    '(APIServer pid=1787) INFO:     127.0.0.1:53910 - "GET /metrics HTTP/1.0" 200 OK',
    '[2026-12-01 18:00:01] INFO:     127.0.0.1:40112 - "GET /metrics HTTP/1.1" 200 OK',
    "srv  log_server_r: request: GET /health 127.0.0.1 200",
]
KEPT_LINES = [
    # What the engine says: kept.
    "(APIServer pid=1787) INFO 12-01 18:00:00 [api_server.py:1] Starting vLLM API server",
    '(APIServer pid=1787) INFO:     127.0.0.1:59522 - "POST /v1/completions HTTP/1.1" 200 OK',
    # A poll answered otherwise says something (loading, broken).
    'INFO:     127.0.0.1:59498 - "GET /health HTTP/1.1" 503 Service Unavailable',
    'INFO:     127.0.0.1:53910 - "GET /metrics HTTP/1.1" 500 Internal Server Error',
    "srv  log_server_r: request: GET /health 127.0.0.1 503",
    # Another path, or one that only starts like the polled one.
    'INFO:     127.0.0.1:1 - "GET /v1/models HTTP/1.1" 200 OK',
    'INFO:     127.0.0.1:1 - "GET /healthz HTTP/1.1" 200 OK',
    "ERROR engine core died: RuntimeError",
    "",
]


def test_polls_are_recognised_in_each_engines_format() -> None:
    assert [line for line in POLL_LINES if not polls(line)] == []
    assert [line for line in KEPT_LINES if polls(line)] == []


def test_no_paths_skip_nothing() -> None:
    assert not poll_lines([])(POLL_LINES[0])


@given(st.text(), st.sampled_from(["/health", "/metrics"]), st.integers(201, 599))
def test_a_poll_that_did_not_answer_200_is_kept(prefix: str, path: str, status: int) -> None:
    assert not polls(f'{prefix}"GET {path} HTTP/1.1" {status} X')
    assert not polls(f"{prefix}request: GET {path} 127.0.0.1 {status}")


@given(st.text(alphabet=st.characters(blacklist_characters='"\n')))
def test_a_line_without_a_polled_request_is_kept(text: str) -> None:
    assert not polls(text)


def test_follower_and_file_tail_leave_polls_out(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    lines = ["loading weights", *POLL_LINES * 30, "engine core died", *POLL_LINES * 30]
    log.write_text("\n".join(lines) + "\n")
    follower = OutputFollower(log, "s-0", lines=100, max_bytes=1 << 20, skip=polls)
    follower.read_more()
    assert follower.tail(5) == "loading weights\nengine core died"
    adopted = OutputFollower(log, "s-0", lines=100, max_bytes=1 << 20, skip=polls)
    adopted.refill()
    assert adopted.tail(5) == "loading weights\nengine core died"
    assert file_tail(log, 5, polls) == "loading weights\nengine core died"
    assert file_tail(log, 2).splitlines() == POLL_LINES[-2:]  # unfiltered: polls only
