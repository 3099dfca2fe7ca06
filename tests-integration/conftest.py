from __future__ import annotations

from llmgw_testkit import untimed

# The `cluster` fixture: a whole system over mTLS, stopped (logs shown on failure) after.
from llmgw_testkit.fixtures import cluster, pytest_runtest_makereport

untimed.load()  # no hypothesis deadlines: tests assert no timings

__all__ = ["cluster", "pytest_runtest_makereport"]
