"""The per-model request figures a router reports to the control plane (ReportRequests,
issue 29 point 4): deltas of its own metrics between reports."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from llmgw_router.control.requests import RequestsReporter, model_deltas
from llmgw_router.metrics import Metrics


def test_a_report_carries_what_happened_since_the_last() -> None:
    metrics = Metrics()
    reporter = RequestsReporter(metrics, "r1")
    metrics.requests.labels("chat", "200", "e1").inc(3)
    metrics.requests.labels("chat", "502", "e1").inc()
    metrics.requests.labels("", "404", "").inc()  # no known model: not reported
    metrics.ttft.labels("chat").observe(0.02)
    first = reporter.next_report()
    (chat,) = first.models
    assert (chat.model, chat.requests, chat.errors) == ("chat", 4, 1)
    assert sum(chat.ttft_counts) == 1
    assert len(chat.ttft_bounds) == len(chat.ttft_counts)
    assert reporter.next_report().models == []  # nothing new
    metrics.requests.labels("chat", "200", "e2").inc(2)
    (again,) = reporter.next_report().models
    assert (again.requests, again.errors, list(again.ttft_counts)) == (2, 0, [])


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b"]), st.sampled_from(["200", "500", "503"]), st.integers(0, 9)
        ),
        max_size=20,
    ),
    st.integers(1, 5),
)
def test_deltas_add_up_to_the_totals(increments: list[tuple[str, str, int]], cut: int) -> None:
    """However the increments are split between reports, the reports sum to the totals."""
    metrics = Metrics()
    previous: dict[str, tuple[float, float, tuple[int, ...]]] = {}
    sent = {"a": [0, 0], "b": [0, 0]}
    for i, (model, status, n) in enumerate(increments):
        metrics.requests.labels(model, status, "e").inc(n)
        if i % cut == 0:
            out, previous = model_deltas(metrics.requests.samples(), [], previous)
            for name, requests, errors, _ in out:
                sent[name][0] += requests
                sent[name][1] += errors
    out, previous = model_deltas(metrics.requests.samples(), [], previous)
    for name, requests, errors, _ in out:
        sent[name][0] += requests
        sent[name][1] += errors
    for name in ("a", "b"):
        assert sent[name][0] == sum(n for m, _, n in increments if m == name)
        assert sent[name][1] == sum(n for m, s, n in increments if m == name and s[0] == "5")
