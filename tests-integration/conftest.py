from __future__ import annotations

# The `cluster` fixture: a whole system over mTLS, stopped (logs shown on failure) after.
from llmgw_testkit.fixtures import cluster, pytest_runtest_makereport

__all__ = ["cluster", "pytest_runtest_makereport"]
