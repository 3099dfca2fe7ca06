"""Load reports: each local engine's own figures, read from its metrics, sent up on change.

Every ``interval`` (RegisterAck.load_interval, else agent.yaml's ``load_interval``,
250 ms by default) the agent reads the Prometheus metrics of each READY or DRAINING
engine on loopback: running and waiting requests, KV-cache use, prefix-cache
lookups and hits, the KV cache's size in tokens and the prefill rate the agent learns
from the engine's prompt tokens and prefill seconds (:mod:`llmgw_agent.prefill`), under
each engine's own names (:class:`llmgw_agent.adapters.LoadMetrics`).
Only engines whose figures changed go up, batched into one LoadReport per round; an
engine whose metrics cannot be read is reported once as ``known=false``. ``generation``
is the engine process's launch time in milliseconds: it changes when the engine is
restarted (its cache starts empty) and survives an agent restart (it is in the record).
Reports are sent only while the stream is up; a new stream starts with every engine's
figures again.
"""

from __future__ import annotations

import asyncio
import datetime
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import structlog
from llmgw_proto import v1

from llmgw_agent.adapters import LoadMetrics
from llmgw_agent.prefill import PrefillCounters, PrefillRate
from llmgw_agent.probe import http_get

__all__ = [
    "LoadReporter",
    "LoadSource",
    "engine_load",
    "info_cache_tokens",
    "metric_values",
    "prefill_counters",
]

log = structlog.get_logger(__name__)


def metric_values(text: str, names: Iterable[str]) -> dict[str, float]:
    """The sum of every sample of each metric in ``names`` (counters also as ``NAME_total``).

    One pass over the exposition text; samples of other metrics are skipped, and so are
    lines that do not parse (comments, NaN).
    """
    wanted: dict[str, str] = {}
    for name in names:
        if name:
            wanted[name] = name
            wanted.setdefault(name + "_total", name)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        end = len(line)
        for stop in ("{", " ", "\t"):
            at = line.find(stop)
            if 0 < at < end:
                end = at
        key = wanted.get(line[:end])
        if key is None:
            continue
        rest = line[end:]
        if rest.startswith("{"):
            close = rest.rfind("}")
            rest = rest[close + 1 :] if close >= 0 else ""
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if math.isfinite(value):
            out[key] = out.get(key, 0.0) + value
    return out


def info_cache_tokens(text: str, name: str) -> int:
    """The KV cache in tokens from an info metric's labels (vLLM's ``cache_config_info``):
    its ``kv_cache_size_tokens`` where given, else ``num_gpu_blocks`` x ``block_size``;
    0 when absent or not numbers. A model with sliding-window layers (gemma-3) has its
    layers in several KV groups sharing one pool of blocks: there the blocks hold several
    times fewer prompt tokens than that product (469 blocks of 32 for 2,377 tokens)."""
    head = name + "{"
    for line in text.splitlines():
        if not line.startswith(head):
            continue
        labels: dict[str, str] = {}
        for part in line[len(head) : line.rfind("}")].split(","):
            key, sep, value = part.partition("=")
            if sep:
                labels[key.strip()] = value.strip().strip('"')
        try:
            return max(0, int(labels["kv_cache_size_tokens"]))
        except (KeyError, ValueError):
            pass
        try:
            blocks, size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
        except (KeyError, ValueError):
            return 0
        return max(0, blocks) * max(0, size)
    return 0


def prefill_counters(values: dict[str, float], metrics: LoadMetrics) -> PrefillCounters | None:
    """The engine's cumulative prefill figures among its metric ``values``; None when it
    does not report them."""
    if not metrics.prompt_tokens or not metrics.prefill_seconds:
        return None
    prompt = values.get(metrics.prompt_tokens)
    seconds = values.get(metrics.prefill_seconds)
    if prompt is None or seconds is None:
        return None
    cached = values.get(metrics.prefix_hits, 0.0) if metrics.prefix_hits else 0.0
    return PrefillCounters(prompt, cached, seconds)


def engine_load(
    text: str,
    metrics: LoadMetrics,
    *,
    shard_id: str,
    generation: int,
    prefill: PrefillRate | None = None,
) -> v1.EngineLoad:
    """One engine's load from its metrics text; ``known`` is False without a running count.
    ``prefill``: the engine's rate estimator, given this reading's prefill figures."""
    names = (
        metrics.running,
        metrics.waiting,
        metrics.kv_cache_usage,
        metrics.prefix_queries,
        metrics.prefix_hits,
        metrics.cache_tokens,
        metrics.prompt_tokens,
        metrics.prefill_seconds,
    )
    values = metric_values(text, names)
    if metrics.running not in values:
        return v1.EngineLoad(
            shard_id=shard_id,
            known=False,
            generation=generation,
            prefill_tokens_per_second=prefill.rate if prefill is not None else 0.0,
        )
    kv = values.get(metrics.kv_cache_usage, 0.0)
    rate = prefill.update(prefill_counters(values, metrics)) if prefill is not None else 0.0
    return v1.EngineLoad(
        shard_id=shard_id,
        known=True,
        running=max(0, round(values.get(metrics.running, 0.0))),
        waiting=max(0, round(values.get(metrics.waiting, 0.0))),
        kv_cache_usage=min(1.0, max(0.0, kv)),
        prefix_cache_queries=max(0, round(values.get(metrics.prefix_queries, 0.0))),
        prefix_cache_hits=max(0, round(values.get(metrics.prefix_hits, 0.0))),
        generation=generation,
        cache_tokens=(
            info_cache_tokens(text, metrics.cache_info)
            if metrics.cache_info
            else max(0, round(values.get(metrics.cache_tokens, 0.0)))
        ),
        prefill_tokens_per_second=rate,
    )


@dataclass(frozen=True)
class LoadSource:
    """One engine to read: where its metrics are and what they are called."""

    shard_id: str
    metrics_url: str
    metrics: LoadMetrics
    generation: int
    # The engine's secret (llama-server's /metrics requires it).
    api_key: str = ""


def _key(load: v1.EngineLoad) -> tuple[object, ...]:
    return (
        load.known,
        load.running,
        load.waiting,
        round(load.kv_cache_usage, 4),
        load.prefix_cache_queries,
        load.prefix_cache_hits,
        load.generation,
        load.cache_tokens,
        # Two significant digits: a rate that drifts a little sends no report.
        f"{load.prefill_tokens_per_second:.2g}",
        tuple(load.adapters),
    )


class LoadReporter:
    """Reads the engines each interval and puts changed figures into ``send``."""

    def __init__(
        self,
        sources: Callable[[], list[LoadSource]],
        send: Callable[[v1.LoadReport], None],
        *,
        interval: Callable[[], float],
        session: Callable[[], int],
        adapters: Callable[[str, int], list[str]] | None = None,
    ) -> None:
        self.sources = sources
        # The LoRA adapters an engine holds (shard id, generation), for its reports.
        self.adapters = adapters
        self.send = send
        self.interval = interval
        # A number that changes with each new stream (and is 0 while none is up).
        self.session = session
        self._sent: dict[str, tuple[object, ...]] = {}
        # Per shard, its engine's prefill rate (kept across engine restarts).
        self._prefill: dict[str, PrefillRate] = {}
        self._session = 0
        self.reports = 0

    async def read(self, source: LoadSource) -> v1.EngineLoad:
        timeout = max(0.5, 2 * self.interval())
        try:
            status, body = await http_get(
                source.metrics_url, timeout=timeout, api_key=source.api_key
            )
        except (OSError, TimeoutError):
            status, body = 0, b""
        prefill = self._prefill.get(source.shard_id)
        if prefill is None:
            prefill = self._prefill[source.shard_id] = PrefillRate()
        if status != 200:
            return v1.EngineLoad(
                shard_id=source.shard_id,
                known=False,
                generation=source.generation,
                prefill_tokens_per_second=prefill.rate,
            )
        return engine_load(
            body.decode(errors="replace"),
            source.metrics,
            shard_id=source.shard_id,
            generation=source.generation,
            prefill=prefill,
        )

    async def round(self) -> v1.LoadReport | None:
        """Read every engine once; the report of what changed (None: nothing, or no stream)."""
        session = self.session()
        if session == 0:
            return None
        if session != self._session:
            self._session = session
            self._sent.clear()  # a new stream: the control plane gets everything again
        sources = self.sources()
        loads = await asyncio.gather(*(self.read(s) for s in sources))
        if self.adapters is not None:
            for load in loads:
                load.adapters = self.adapters(load.shard_id, load.generation)
        live = {s.shard_id for s in sources}
        for gone in set(self._sent) - live:
            del self._sent[gone]
        for gone in set(self._prefill) - live:
            del self._prefill[gone]
        changed = [load for load in loads if self._sent.get(load.shard_id) != _key(load)]
        if not changed:
            return None
        for load in changed:
            self._sent[load.shard_id] = _key(load)
        report = v1.LoadReport(engines=changed, time=datetime.datetime.now(datetime.UTC))
        self.send(report)
        self.reports += 1
        return report

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            try:
                await self.round()
            except Exception as err:  # a bug here must not stop the agent's other work
                log.warning("load report round failed", error=f"{type(err).__name__}: {err}")
            await asyncio.sleep(max(0.01, self.interval() - (loop.time() - began)))
