"""Command-line pieces every llmgw program shares: log flags and config errors."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from llmgw_proto.config import ConfigError, load
from llmgw_proto.logs import LOG_FORMATS, LOG_LEVELS, setup_logging

__all__ = ["fail", "load_config_or_exit", "log_options"]

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``message`` to stderr and exit: bad input never ends in a traceback."""
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def load_config_or_exit(path: Path | str, type_: type[T]) -> T:
    try:
        return load(path, type_)
    except ConfigError as err:
        fail(str(err))


def log_options(func: F) -> F:
    """Add ``--log-level`` and ``--log-format`` and configure logging before ``func`` runs."""

    @click.option(
        "--log-level",
        type=click.Choice(LOG_LEVELS, case_sensitive=False),
        default="info",
        show_default=True,
        help="Lowest level that is logged.",
    )
    @click.option(
        "--log-format",
        type=click.Choice(LOG_FORMATS),
        default="auto",
        show_default=True,
        help="auto: human-readable on a terminal, JSON lines otherwise.",
    )
    @functools.wraps(func)
    def wrapper(*args: Any, log_level: str, log_format: str, **kwargs: Any) -> Any:
        setup_logging(log_level, log_format)
        return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
