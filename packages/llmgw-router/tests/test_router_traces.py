"""The router's spans, exported over OTLP to a real receiver (llmgw_testkit.otlp): a
router process and a simulated engine, requests with and without the client's
traceparent, a retried attempt; and the engine gets the attempt's traceparent."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from llmgw_proto.tracing import format_traceparent, parse_traceparent
from llmgw_testkit import Proc, free_port, http_get, wait_for
from llmgw_testkit.otlp import OtlpReceiver, Span

BIN = Path(sys.executable).parent
# Export every 100 ms instead of every 5 s: the spans are there soon after each request.
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}


@dataclass
class Fleet:
    otlp: OtlpReceiver
    router: str
    engine: str


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("traces")
    procs: list[Proc] = []
    with OtlpReceiver() as otlp:
        try:
            sim_port = free_port()
            argv = [str(BIN / "llmgw-sim"), "vllm", "serve", "m1", "--host", "127.0.0.1"]
            argv += ["--port", str(sim_port), "--sim-load-time", "0", "--sim-script-routes"]
            procs.append(Proc(argv, log_dir=tmp, name="sim"))
            engine = f"http://127.0.0.1:{sim_port}"
            wait_for(lambda: http_get(engine + "/health")[0] == 200, timeout=60, what="sim")
            port, admin = free_port(), free_port()
            config = {
                "listen": f"127.0.0.1:{port}",
                "admin_listen": f"127.0.0.1:{admin}",
                "workers": 1,
                "balancer": "least_outstanding",
                "api_keys": [{"key": "sk-alice", "name": "alice"}],
                # A dead endpoint first: the first attempt may fail and be retried.
                "endpoints": [
                    {"id": "sim", "url": engine, "models": ["m1"]},
                    {"id": "dead", "url": f"http://127.0.0.1:{free_port()}", "models": ["m9"]},
                ],
                "tracing": {"endpoint": otlp.url, "service_name": "router-under-test"},
            }
            path = tmp / "router.yaml"
            path.write_text(yaml.safe_dump(config))
            argv = [str(BIN / "llmgw-router"), "serve", "--config", str(path)]
            router = Proc(argv, log_dir=tmp, name="router", env=FAST_EXPORT)
            procs.append(router)
            wait_for(
                lambda: router.alive() and http_get(f"http://127.0.0.1:{admin}/readyz")[0] == 200,
                timeout=60,
                what="router /readyz",
            )
            yield Fleet(otlp, f"http://127.0.0.1:{port}", engine)
        finally:
            for proc in reversed(procs):
                proc.stop()


def _auth(**more: str) -> dict[str, str]:
    return {"authorization": "Bearer sk-alice", **more}


def _trace_of(otlp: OtlpReceiver, trace_id: str, names: set[str]) -> dict[str, Span]:
    spans = otlp.wait_for_spans(
        lambda spans: names <= {s.name for s in spans if s.trace_id == trace_id},
        what=f"spans {sorted(names)} of trace {trace_id}",
    )
    return {s.name: s for s in spans if s.trace_id == trace_id}


def test_a_request_is_one_trace_under_the_clients_parent(fleet: Fleet) -> None:
    client_parent = format_traceparent(0x1234ABCD, 0x42, True)
    resp = httpx.post(
        fleet.router + "/v1/responses",
        json={"model": "m1", "input": "hello"},
        headers=_auth(traceparent=client_parent),
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    trace_id = f"{0x1234ABCD:032x}"
    spans = _trace_of(fleet.otlp, trace_id, {"llmgw.request", "llmgw.upstream", "llmgw.first_byte"})
    request, attempt, first = (
        spans["llmgw.request"],
        spans["llmgw.upstream"],
        spans["llmgw.first_byte"],
    )
    assert request.service == "router-under-test"
    assert request.parent_id == f"{0x42:016x}"
    assert attempt.parent_id == request.span_id
    assert first.parent_id == attempt.span_id
    assert request.attributes["llmgw.key"] == "alice"
    admission = _trace_of(fleet.otlp, trace_id, {"llmgw.admission"})["llmgw.admission"]
    assert admission.attributes["llmgw.key"] == "alice"
    assert request.attributes["llmgw.model"] == "m1"
    assert request.attributes["llmgw.balancer"] == "least_outstanding"
    assert request.attributes["llmgw.pick_reason"]
    assert request.attributes["llmgw.endpoint"] == "sim"
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["http.route"] == "/v1/responses"
    # The Responses API's usage (input_tokens, output_tokens) counted as tokens too.
    assert request.attributes["llmgw.tokens.prompt"] > 0
    assert request.attributes["llmgw.tokens.completion"] == 8
    assert attempt.attributes["endpoint"] == "sim"
    assert first.attributes["status"] == 200
    # The engine got the attempt's traceparent: same trace, the attempt as its parent.
    sent = parse_traceparent(resp.headers["x-sim-traceparent"])
    assert sent is not None
    assert (f"{sent[0]:032x}", f"{sent[1]:016x}") == (trace_id, attempt.span_id)


def test_tokens_counted_on_the_request_span(fleet: Fleet) -> None:
    parent = format_traceparent(0x77, 0x78, True)
    resp = httpx.post(
        fleet.router + "/v1/chat/completions",
        json={"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
        headers=_auth(traceparent=parent),
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    spans = _trace_of(fleet.otlp, f"{0x77:032x}", {"llmgw.request"})
    attrs = spans["llmgw.request"].attributes
    assert attrs["llmgw.tokens.completion"] == 5
    assert attrs["llmgw.tokens.prompt"] > 0


def test_a_request_without_a_parent_starts_a_trace_and_errors_are_spans(fleet: Fleet) -> None:
    resp = httpx.post(
        fleet.router + "/v1/chat/completions",
        json={"model": "m9", "messages": [{"role": "user", "content": "hi"}]},
        headers=_auth(),
        timeout=30,
    )
    assert resp.status_code == 502
    spans = fleet.otlp.wait_for_spans(
        lambda spans: any(
            s.name == "llmgw.request" and s.attributes.get("http.response.status_code") == 502
            for s in spans
        ),
        what="the 502's request span",
    )
    request = next(
        s
        for s in spans
        if s.name == "llmgw.request" and s.attributes.get("http.response.status_code") == 502
    )
    assert request.parent_id == ""
    assert request.failed
    attempts = [s for s in fleet.otlp.trace(request.trace_id) if s.name == "llmgw.upstream"]
    assert attempts
    assert all(a.failed and a.attributes["endpoint"] == "dead" for a in attempts)
    assert "exception" in attempts[0].events
