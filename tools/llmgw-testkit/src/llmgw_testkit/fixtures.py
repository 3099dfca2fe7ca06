"""pytest pieces for suites that run a whole system; a conftest.py imports them:

from llmgw_testkit.fixtures import cluster, pytest_runtest_makereport  # noqa: F401
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from llmgw_testkit.cluster import Cluster

__all__ = ["cluster", "pytest_runtest_makereport"]


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """A system over mutual TLS; every process it started (engines too) is stopped after.

    When the test failed, the last lines of every program's and engine's log are printed.
    """
    system = Cluster(tmp_path)
    try:
        yield system
    finally:
        system.stop()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            logs = [*system.logs.glob("*.log"), *(tmp_path / "state").glob("*/logs/*.log")]
            for log in sorted(logs):
                print(f"----- {log.name} (last 40 lines)")
                print("\n".join(log.read_text(errors="replace").splitlines()[-40:]))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keep each phase's report on the test item, for fixtures that look at the outcome."""
    report: pytest.TestReport = yield
    setattr(item, f"rep_{report.when}", report)
    return report
