"""The hypothesis profile every llmgw test suite loads (from its conftest.py): no
per-example deadline and no too-slow health check.

A deadline is a timing assertion, and the suites run beside real processes on loaded
machines (two cores, pytest-xdist workers, engines starting): an example that takes
300 ms there says nothing about the property. Speed is measured by tools/bench/, not
asserted by tests.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

__all__ = ["load"]

PROFILE = "llmgw-untimed"


def load() -> None:
    settings.register_profile(PROFILE, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile(PROFILE)
