from __future__ import annotations

import io
import json
import logging

import structlog
from llmgw_proto.logs import setup_logging


class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_json_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    setup_logging("info", "auto", stream=out)
    structlog.get_logger("t").info("node registered", node="gpu-a")
    logging.getLogger("grpclib").warning("from the standard library")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines[0]["event"] == "node registered"
    assert lines[0]["node"] == "gpu-a"
    assert lines[0]["level"] == "info"
    assert lines[1]["event"] == "from the standard library"
    assert lines[1]["logger"] == "grpclib"


def test_human_lines_on_a_terminal_and_level_filter() -> None:
    out = TTY()
    setup_logging("warning", "auto", stream=out)
    structlog.get_logger("t").info("hidden")
    structlog.get_logger("t").warning("shown", replica="r1")
    text = out.getvalue()
    assert "hidden" not in text
    assert "shown" in text
    assert "replica=r1" in text
    assert not text.lstrip().startswith("{")


def test_format_flag_overrides_detection() -> None:
    out = TTY()
    setup_logging("debug", "json", stream=out)
    structlog.get_logger("t").debug("x")
    assert json.loads(out.getvalue())["event"] == "x"
