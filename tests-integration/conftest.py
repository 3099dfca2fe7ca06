from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from llmgw_testkit.cluster import Cluster


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """A system over mutual TLS; every process it started is stopped afterwards."""
    system = Cluster(tmp_path)
    try:
        yield system
    finally:
        system.stop()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            for log in sorted(system.logs.glob("*.log")):
                print(f"----- {log.name} (last 40 lines)")
                print("\n".join(log.read_text(errors="replace").splitlines()[-40:]))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report: pytest.TestReport = yield
    setattr(item, f"rep_{report.when}", report)
    return report
