"""A short history of each model's figures, for the status page's sparklines.

Every ``step`` seconds the control plane takes one sample per model from what it
already holds (no new reports): replicas wanted and ready, and from the engines' load
reports the requests running and waiting and the mean KV-cache use of the ready
replicas that report one. An hour of samples is kept (``points``), in memory only: a
restarted control plane starts an empty history. :func:`model_rows` is pure and
tested apart from the clock; :class:`History` is the ring buffer.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger(__name__)

__all__ = ["STEP", "History", "ModelFigures", "model_rows", "run_sampler"]

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

    def as_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "wanted": self.wanted,
            "ready": self.ready,
            "running": self.running,
            "waiting": self.waiting,
            "kv_cache": None if self.kv_cache is None else round(self.kv_cache, 4),
        }


def model_rows(
    wanted: Mapping[str, int],
    replicas: Iterable[tuple[str, str, Mapping[str, Any] | None]],
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
    return [
        ModelFigures(
            m,
            wanted.get(m, 0),
            ready.get(m, 0),
            running.get(m, 0),
            waiting.get(m, 0),
            sum(kv[m]) / len(kv[m]) if kv.get(m) else None,
        )
        for m in sorted(models)
    ]


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
                for key in ("ready", "wanted", "running", "waiting", "kv_cache")
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
