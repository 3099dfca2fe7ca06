"""llmgw_proto.tracing: traceparent parsing, the no-op when off, parents and links."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st
from llmgw_proto import tracing
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

ids128 = st.integers(min_value=1, max_value=2**128 - 1)
ids64 = st.integers(min_value=1, max_value=2**64 - 1)


@given(ids128, ids64, st.booleans())
def test_traceparent_round_trip(trace_id: int, span_id: int, sampled: bool) -> None:
    text = tracing.format_traceparent(trace_id, span_id, sampled)
    assert tracing.parse_traceparent(text) == (trace_id, span_id, sampled)


@given(st.text(max_size=80))
def test_parse_never_raises(text: str) -> None:
    parsed = tracing.parse_traceparent(text)
    assert parsed is None or (parsed[0] > 0 and parsed[1] > 0)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "00-" + "0" * 32 + "-" + "1" * 16 + "-01",
        "00-" + "1" * 32 + "-" + "0" * 16 + "-01",
        "ff-" + "1" * 32 + "-" + "1" * 16 + "-01",
        "00-" + "1" * 31 + "-" + "1" * 16 + "-01",
        "garbage",
    ],
)
def test_parse_refuses(text: str) -> None:
    assert tracing.parse_traceparent(text) is None


def test_off_is_a_shared_noop() -> None:
    assert not tracing.enabled()
    with tracing.span("x", a=1) as s:
        s.set(b=2)
        s.event("e")
        s.fail("no")
        assert s.traceparent() is None
        assert tracing.traceparent() is None
    assert tracing.span("y") is tracing.span("z")


@pytest.fixture
def recorded() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    try:
        yield exporter
    finally:
        tracing.shutdown()


def test_spans_parents_links_attributes(recorded: InMemorySpanExporter) -> None:
    remote = tracing.format_traceparent(0xABC, 0xDEF, True)
    other = tracing.format_traceparent(0x123, 0x456, True)
    with tracing.span("outer", parent=remote, links=[other, "bad"], model="m", skip=None) as s:
        s.set(status=200)
        inner_tp = None
        with tracing.span("inner"):
            inner_tp = tracing.traceparent()
    spans = {sp.name: sp for sp in recorded.get_finished_spans()}
    outer, inner = spans["outer"], spans["inner"]
    assert outer.context is not None
    assert inner.context is not None
    assert outer.context.trace_id == 0xABC
    assert outer.parent is not None
    assert outer.parent.span_id == 0xDEF
    assert [link.context.trace_id for link in outer.links] == [0x123]
    assert dict(outer.attributes or {}) == {"model": "m", "status": 200}
    assert inner.parent is not None
    assert inner.parent.span_id == outer.context.span_id
    assert inner_tp == tracing.format_traceparent(0xABC, inner.context.span_id, True)


def test_exception_marks_the_span_failed(recorded: InMemorySpanExporter) -> None:
    with pytest.raises(RuntimeError), tracing.span("boom"):
        raise RuntimeError("x")
    (sp,) = recorded.get_finished_spans()
    assert not sp.status.is_ok
