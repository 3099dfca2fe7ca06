"""What this router answered, per model, told to the control plane (`ReportRequests`).

Every few seconds, on the channel the endpoint watcher holds to the leader: per model,
the requests answered since the previous report, the 5xx among them, and the time to
first token as bucket counts, read from this router's own metrics (nothing is added
to the request path). Each worker reports its own share. The control plane's status
page turns them into requests/s, error rate and TTFT p50/p90 per model.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Mapping
from typing import Any

import structlog
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError
from llmgw_proto.v1 import ModelRequests, RequestReply, RequestReport

from llmgw_router.metrics import Metrics
from llmgw_router.state import now

__all__ = ["INTERVAL", "RequestsReporter", "model_deltas"]

log = structlog.get_logger(__name__)

_REPORT = "/llmgw.v1.EndpointService/ReportRequests"
INTERVAL = 5.0

# model -> (requests, errors, TTFT counts per bucket)
Totals = dict[str, tuple[float, float, tuple[int, ...]]]


def model_deltas(
    requests: Iterable[tuple[tuple[str, ...], float]],
    ttft: Iterable[tuple[tuple[str, ...], list[int]]],
    previous: Mapping[str, tuple[float, float, tuple[int, ...]]],
) -> tuple[list[tuple[str, int, int, tuple[int, ...]]], Totals]:
    """Per model with anything new since ``previous``: (model, requests, errors, TTFT
    bucket counts), and the totals to compare the next report with. ``requests`` are
    the counter's (model, status, endpoint) samples, ``ttft`` the histogram's (model,)
    per-bucket counts. Requests for no known model (``model=""``) are left out."""
    totals: dict[str, list[Any]] = {}
    for (model, status, *_), value in requests:
        if not model:
            continue
        entry = totals.setdefault(model, [0.0, 0.0, ()])
        entry[0] += value
        if status.startswith("5"):
            entry[1] += value
    for (model, *_), counts in ttft:
        if model:
            totals.setdefault(model, [0.0, 0.0, ()])[2] = tuple(counts)
    out = []
    new: Totals = {}
    for model, (count, errors, buckets) in sorted(totals.items()):
        new[model] = (count, errors, buckets)
        before = previous.get(model, (0.0, 0.0, ()))
        d_requests = max(0, int(count - before[0]))
        d_errors = max(0, int(errors - before[1]))
        old = before[2] if len(before[2]) == len(buckets) else (0,) * len(buckets)
        d_buckets = tuple(max(0, a - b) for a, b in zip(buckets, old, strict=True))
        if d_requests or d_errors or any(d_buckets):
            out.append((model, d_requests, d_errors, d_buckets))
    return out, new


class RequestsReporter:
    """Sends this router's per-model request figures every ``interval`` seconds."""

    def __init__(self, metrics: Metrics, router_id: str, interval: float = INTERVAL) -> None:
        self.metrics = metrics
        self.router_id = router_id
        self.interval = interval
        self._totals: Totals = {}
        self._last = 0.0

    def next_report(self) -> RequestReport:
        metrics = self.metrics
        models, self._totals = model_deltas(
            metrics.requests.samples(), metrics.ttft.samples(), self._totals
        )
        at = now()
        interval = at - self._last if self._last else 0.0
        self._last = at
        bounds = [b if math.isfinite(b) else math.inf for b in metrics.ttft.bounds]
        return RequestReport(
            router_id=self.router_id,
            interval=interval,
            models=[
                ModelRequests(
                    model=model,
                    requests=count,
                    errors=errors,
                    ttft_bounds=bounds if any(buckets) else [],
                    ttft_counts=list(buckets) if any(buckets) else [],
                )
                for model, count, errors, buckets in models
            ],
        )

    async def report(self, channel: Channel) -> None:
        """Until cancelled; a control plane without ReportRequests ends it quietly."""
        while True:
            await asyncio.sleep(self.interval)
            report = self.next_report()
            try:
                async with channel.request(
                    _REPORT,
                    Cardinality.UNARY_UNARY,
                    RequestReport,
                    RequestReply,
                    timeout=max(1.0, 2 * self.interval),
                ) as stream:
                    await stream.send_message(report, end=True)
                    await stream.recv_message()
            except GRPCError as err:
                if err.status is Status.UNIMPLEMENTED:
                    log.info("the control plane does not take ReportRequests")
                    return
                log.warning("request report failed", error=f"{err.status.name}: {err.message}")
            except Exception as err:
                # These figures are for a page: what was lost is not sent again.
                log.warning("request report failed", error=f"{type(err).__name__}: {err}")
