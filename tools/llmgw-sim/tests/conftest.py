"""Shared fixtures; the process helpers live in llmgw_sim.testing."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from llmgw_testkit import untimed

untimed.load()  # no hypothesis deadlines: tests assert no timings


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as c:
        yield c
