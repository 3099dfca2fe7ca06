"""structlog, configured once per program.

Human-readable lines on a terminal, JSON lines otherwise (what log shippers
want). The standard library's loggers (grpclib, aiohttp, hypercorn) go through
the same renderer so one process never writes two formats.
"""

from __future__ import annotations

import logging
import sys

import structlog

__all__ = ["LOG_FORMATS", "LOG_LEVELS", "setup_logging"]

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "console", "json")


def setup_logging(level: str = "info", fmt: str = "auto", *, stream: object = None) -> None:
    """Configure structlog and stdlib logging for the whole process."""
    out = stream if stream is not None else sys.stderr
    if fmt == "auto":
        isatty = getattr(out, "isatty", None)
        fmt = "console" if callable(isatty) and isatty() else "json"
    numeric = logging.getLevelNamesMapping()[level.upper()]

    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.typing.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
        shared.append(structlog.processors.format_exc_info)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)

    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(out)  # type: ignore[arg-type]
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=shared,
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
