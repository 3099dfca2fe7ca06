"""The control plane's /metrics page (issue 29 point 10): each family declared once,
refusal counters present at 0 before the first refusal, engine restarts per profile."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st
from llmgw_control.metrics import KNOWN_REFUSALS, Metrics, failures_by_profile
from prometheus_client import generate_latest


@dataclass
class R:
    model: str
    profile: str
    failures: int


def page() -> str:
    metrics = Metrics()
    metrics.count_fleet(
        lambda: {"READY": 2, "UNREACHABLE": 1}, lambda: {("chat", "default", "ready"): 2}
    )
    metrics.count_lifecycle(dict, dict)
    metrics.count_failures(
        lambda: failures_by_profile([("chat", "default")], [R("chat", "default", 2)])
    )
    return generate_latest(metrics.registry).decode()


def test_every_family_is_declared_once() -> None:
    text = page()
    declared = [line for line in text.splitlines() if line.startswith(("# HELP", "# TYPE"))]
    assert len(declared) == len(set(declared)), [d for d in declared if declared.count(d) > 1]
    assert text.count("# TYPE llmgw_control_nodes gauge") == 1
    assert text.count("# TYPE llmgw_control_replicas gauge") == 1
    assert 'llmgw_control_nodes{state="UNREACHABLE"} 1.0' in text
    assert 'llmgw_control_replica_failures{model="chat",profile="default"} 2.0' in text


def test_refusals_are_counted_from_zero() -> None:
    text = page()
    for stream, reason in KNOWN_REFUSALS:
        assert f'llmgw_control_refusals_total{{reason="{reason}",stream="{stream}"}} 0.0' in text


def test_promtool_finds_nothing_to_say() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        import pytest

        pytest.skip("promtool is missing: apt-get install prometheus (noxfile.py installs it)")
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=page(), capture_output=True, text=True, timeout=60
    )
    # promtool's lint (counters named _total, units, ...) may advise; an error fails it.
    assert "error" not in (checked.stdout + checked.stderr).lower(), checked
    assert "HELP" not in checked.stdout + checked.stderr, checked


names = st.sampled_from(["a", "b", "c"])


@given(
    st.lists(st.tuples(names, names), max_size=4),
    st.lists(st.builds(R, names, names, st.integers(0, 9)), max_size=8),
)
def test_failures_by_profile(profiles: list[tuple[str, str]], replicas: list[R]) -> None:
    out = failures_by_profile(profiles, replicas)
    for key in profiles:
        assert key in out
    for key, count in out.items():
        mine = [r.failures for r in replicas if (r.model, r.profile) == key]
        assert count == max(mine, default=0)
