"""A short history of each model's figures, for the status page's sparklines.

Every ``step`` seconds the control plane takes one sample per model from what it
holds: replicas wanted and ready; from the engines' load reports the requests running
and waiting and the mean KV-cache use of the ready replicas that report one; and from
the routers' ``ReportRequests`` (:class:`RequestIntake`) the requests per second, the
share answered 5xx and the time to first token (p50, p90) since the previous sample. An hour of samples is kept (``points``), in memory only: a
restarted control plane starts an empty history. :func:`model_rows` is pure and
tested apart from the clock; :class:`History` is the ring buffer.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError
from llmgw_proto import v1

log = structlog.get_logger(__name__)

__all__ = [
    "STEP",
    "History",
    "ModelFigures",
    "RequestFigures",
    "RequestIntake",
    "model_rows",
    "quantile",
    "run_sampler",
]

STEP = 10.0  # seconds between samples
POINTS = 360  # an hour of them


@dataclass(frozen=True)
class ModelFigures:
    """One model at one moment."""

    model: str
    wanted: int
    ready: int
    running: int
    waiting: int
    # Mean KV-cache use (0..1) of the ready replicas that report it; None: none does.
    kv_cache: float | None
    # From the routers since the previous sample (None: no router reported the model).
    requests_per_s: float | None = None
    error_rate: float | None = None
    ttft_p50: float | None = None
    ttft_p90: float | None = None

    def as_json(self) -> dict[str, Any]:
        def r(x: float | None, digits: int = 4) -> float | None:
            return None if x is None else round(x, digits)

        return {
            "model": self.model,
            "wanted": self.wanted,
            "ready": self.ready,
            "running": self.running,
            "waiting": self.waiting,
            "kv_cache": r(self.kv_cache),
            "requests_per_s": r(self.requests_per_s, 3),
            "error_rate": r(self.error_rate),
            "ttft_p50": r(self.ttft_p50),
            "ttft_p90": r(self.ttft_p90),
        }


@dataclass(frozen=True)
class RequestFigures:
    """One model's requests at the routers over one sample's time."""

    requests_per_s: float
    error_rate: float | None
    ttft_p50: float | None
    ttft_p90: float | None


def quantile(q: float, buckets: Mapping[float, int]) -> float | None:
    """The ``q`` quantile of per-bucket counts keyed by upper bound, interpolated inside
    its bucket as Prometheus' histogram_quantile does; None without counts. A quantile
    in the +Inf bucket is the highest finite bound."""
    total = sum(buckets.values())
    if total <= 0:
        return None
    rank = q * total
    below, lower = 0, 0.0
    for bound in sorted(buckets):
        count = buckets[bound]
        if count and below + count >= rank:
            if bound == math.inf:
                return lower
            return lower + (bound - lower) * (rank - below) / count
        below += count
        if bound != math.inf:
            lower = bound
    return lower


class RequestIntake:
    """The routers' ``ReportRequests``, summed per model until the next sample takes them."""

    MAX_MODELS = 4096

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._since = clock()
        # model -> [requests, errors, {bound: count}]
        self._acc: dict[str, list[Any]] = {}
        self.last: dict[str, RequestFigures] = {}

    def add(self, report: Any) -> str | None:
        """Take one report (a v1.RequestReport); the reason it was refused, else None."""
        if not report.router_id or len(report.router_id) > 253:
            return "router_id: 1 to 253 characters"
        for m in report.models:
            if not m.model or len(m.model) > 1024:
                return "models[].model: 1 to 1024 characters"
            if len(m.ttft_bounds) != len(m.ttft_counts) or len(m.ttft_bounds) > 64:
                return f"models[{m.model}]: ttft_bounds and ttft_counts must pair up (64 at most)"
        for m in report.models:
            if m.model not in self._acc and len(self._acc) >= self.MAX_MODELS:
                continue
            acc = self._acc.setdefault(m.model, [0, 0, {}])
            acc[0] += m.requests
            acc[1] += m.errors
            for bound, count in zip(m.ttft_bounds, m.ttft_counts, strict=True):
                acc[2][bound] = acc[2].get(bound, 0) + count
        return None

    def take(self) -> dict[str, RequestFigures]:
        """Figures since the previous take (kept as ``last``), and start again."""
        at = self.clock()
        elapsed = max(at - self._since, 1e-3)
        self._since = at
        out = {
            model: RequestFigures(
                requests / elapsed,
                errors / requests if requests else None,
                quantile(0.5, buckets),
                quantile(0.9, buckets),
            )
            for model, (requests, errors, buckets) in self._acc.items()
        }
        self._acc = {}
        self.last = out
        return out

    async def _report(self, stream: Any) -> None:
        report = await stream.recv_message()
        why = self.add(report) if report is not None else "empty report"
        if why is not None:
            raise GRPCError(Status.INVALID_ARGUMENT, f"request report refused: {why}")
        await stream.send_message(v1.RequestReply())

    def __mapping__(self) -> dict[str, Handler]:
        return {
            "/llmgw.v1.EndpointService/ReportRequests": Handler(
                self._report, Cardinality.UNARY_UNARY, v1.RequestReport, v1.RequestReply
            )
        }


def model_rows(
    wanted: Mapping[str, int],
    replicas: Iterable[tuple[str, str, Mapping[str, Any] | None]],
    requests: Mapping[str, RequestFigures] | None = None,
) -> list[ModelFigures]:
    """Per model: ``wanted`` replicas; ``replicas`` are (model, state, load figures or
    None), the load as the status shows it (``running``, ``waiting``, ``kv_cache_usage``,
    ``known``). A model appears when it is wanted or has a replica."""
    ready: dict[str, int] = {}
    running: dict[str, int] = {}
    waiting: dict[str, int] = {}
    kv: dict[str, list[float]] = {}
    models = set(wanted)
    for model, state, load in replicas:
        models.add(model)
        if state != "ready":
            continue
        ready[model] = ready.get(model, 0) + 1
        if load is not None and load.get("known", True):
            running[model] = running.get(model, 0) + int(load.get("running", 0))
            waiting[model] = waiting.get(model, 0) + int(load.get("waiting", 0))
            kv.setdefault(model, []).append(float(load.get("kv_cache_usage", 0.0)))
    requests = requests or {}
    models.update(requests)
    rows = []
    for m in sorted(models):
        figures = requests.get(m)
        rows.append(
            ModelFigures(
                m,
                wanted.get(m, 0),
                ready.get(m, 0),
                running.get(m, 0),
                waiting.get(m, 0),
                sum(kv[m]) / len(kv[m]) if kv.get(m) else None,
                figures.requests_per_s if figures else None,
                figures.error_rate if figures else None,
                figures.ttft_p50 if figures else None,
                figures.ttft_p90 if figures else None,
            )
        )
    return rows


class History:
    """The last ``points`` samples per model, ``step`` seconds apart."""

    def __init__(self, step: float = STEP, points: int = POINTS) -> None:
        self.step = step
        self.points = points
        self._times: deque[float] = deque(maxlen=points)
        self._samples: deque[dict[str, ModelFigures]] = deque(maxlen=points)

    def add(self, at: float, rows: Iterable[ModelFigures]) -> None:
        self._times.append(at)
        self._samples.append({r.model: r for r in rows})

    def as_json(self) -> dict[str, Any]:
        """``{step, times[], models: {model: {ready[], wanted[], running[], waiting[],
        kv_cache[]}}}``: one value per sample, null where the model had none then."""
        names: set[str] = set()
        for sample in self._samples:
            names.update(sample)
        series: dict[str, dict[str, list[Any]]] = {}
        for name in sorted(names):
            rows = [sample.get(name) for sample in self._samples]
            series[name] = {
                key: [None if r is None else getattr(r, key) for r in rows]
                for key in (
                    "ready",
                    "wanted",
                    "running",
                    "waiting",
                    "kv_cache",
                    "requests_per_s",
                    "error_rate",
                    "ttft_p50",
                    "ttft_p90",
                )
            }
        return {"step": self.step, "times": list(self._times), "models": series}


async def run_sampler(
    history: History,
    take: Callable[[], list[ModelFigures]],
    clock: Callable[[], float] = time.time,
) -> None:
    """Sample every ``history.step`` seconds until cancelled; a failing sample is skipped."""
    while True:
        try:
            history.add(clock(), take())
        except Exception as err:  # the page's history must not stop the control plane
            log.warning("status history sample skipped", error=repr(err))
        await asyncio.sleep(history.step)
