"""`llmgw-router` command line."""

from __future__ import annotations

import click

from llmgw_router import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="llmgw-router")
def main() -> None:
    """llmgw-router."""
