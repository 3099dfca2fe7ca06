"""`llmgw-agent` command line."""

from __future__ import annotations

import click

from llmgw_agent import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="llmgw-agent")
def main() -> None:
    """llmgw-agent."""
