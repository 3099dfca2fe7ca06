"""The prefixes routers share (`EndpointService.SharePrefixes`, issue 26).

Several routers in front of one fleet running cache_aware with ``shared_homes`` compute
each prefix's home by a rule that needs the set of recent prefixes (each by its
rendezvous block's hash and its size in blocks). A router that sees only its part of
the traffic computes the homes from its part, and routers that saw different parts
disagree. Every second or so each router reports the prefixes of its recent picks (and
the endpoint it last sent each to); the reply is the union of every router's report
still fresh, so that all compute the homes from the same fleet-wide set, and a prefix
already held goes where most of its requests went.

:func:`merge` and :class:`PrefixBook` are pure (the book is given the time); the
handler is :class:`PrefixShare`. Bounded: a report holds at most :data:`MAX_KEYS` keys
over at most :data:`MAX_MODELS` models (more is refused, naming what is over), the book
keeps one report per router for :data:`MAX_ROUTERS` routers (the least recently heard
from is dropped first) and forgets a report :data:`FRESH` seconds after it came; the
union (each key's smallest known size, its counts summed, the holder most of them
name) keeps at most :data:`MAX_UNION` keys, those with the largest counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import grpclib.const
import grpclib.server
from grpclib.exceptions import GRPCError
from llmgw_proto import v1

__all__ = [
    "FRESH",
    "MAX_KEYS",
    "MAX_MODELS",
    "MAX_ROUTERS",
    "MAX_UNION",
    "PrefixBook",
    "PrefixShare",
    "Prefixes",
    "from_wire",
    "merge",
    "report_problem",
    "to_wire",
]

# A router's report counts in the union for this long after it came (seconds).
FRESH = 10.0
MAX_KEYS = 4096
MAX_MODELS = 64
MAX_ROUTERS = 1024
MAX_UNION = 16384
MAX_ID = 253
MAX_MODEL = 1024
# The union is computed again at most this often (seconds): each report would
# otherwise cost every router's keys again.
RECOMPUTE = 0.25

# model -> key -> (size in blocks, count, holder: an endpoint id or "")
Prefixes = dict[str, dict[int, tuple[int, int, str]]]


def merge(reports: Iterable[Mapping[str, Mapping[int, tuple[int, int, str]]]]) -> Prefixes:
    """The union of ``reports``, per model: each key with the smallest size any report
    gives it (0, not known, only where none knows it), the sum of its counts, and the
    holder the most of its counts name (equal: the smaller id; "" where none names one).

    The smallest size: a router's size for a prefix is what its last two prompts with it
    share, but the whole prompt (its own tail too) while it has seen only one; the
    smallest is the part the tenant's prompts share."""
    out: Prefixes = {}
    votes: dict[tuple[str, int], dict[str, int]] = {}
    for report in reports:
        for model, keys in report.items():
            into = out.setdefault(model, {})
            for key, (size, count, holder) in keys.items():
                was = into.get(key)
                if was is None:
                    into[key] = (size, count, holder)
                else:
                    least = min(was[0], size) if was[0] and size else was[0] or size
                    into[key] = (least, was[1] + count, was[2])
                if holder:
                    tally = votes.setdefault((model, key), {})
                    tally[holder] = tally.get(holder, 0) + max(1, count)
    for (model, key), tally in votes.items():
        size, count, _ = out[model][key]
        out[model][key] = (size, count, min(tally, key=lambda h: (-tally[h], h)))
    return out


def bounded(prefixes: Prefixes, limit: int) -> Prefixes:
    """``prefixes`` with at most ``limit`` keys in all: those with the largest counts
    (equal counts: the smaller key, model), the rest dropped."""
    total = sum(len(keys) for keys in prefixes.values())
    if total <= limit:
        return prefixes
    ranked = sorted(
        ((count, model, key, size, holder) for model, keys in prefixes.items()
         for key, (size, count, holder) in keys.items()),
        key=lambda r: (-r[0], r[2], r[1]),
    )  # fmt: skip
    out: Prefixes = {}
    for count, model, key, size, holder in ranked[:limit]:
        out.setdefault(model, {})[key] = (size, count, holder)
    return out


def report_problem(report: v1.PrefixReport) -> str | None:
    """Why ``report`` cannot be taken (naming the field); None when it can."""
    if not report.router_id or len(report.router_id) > MAX_ID:
        return f"router_id: 1 to {MAX_ID} characters, got {len(report.router_id)}"
    if len(report.models) > MAX_MODELS:
        return f"models: at most {MAX_MODELS}, got {len(report.models)}"
    keys = 0
    for i, m in enumerate(report.models):
        if len(m.model) > MAX_MODEL:
            return f"models[{i}].model: at most {MAX_MODEL} characters, got {len(m.model)}"
        keys += len(m.keys)
        for k in m.keys:
            if len(k.holder) > MAX_ID:
                return f"models[{i}].keys[{k.key}].holder: at most {MAX_ID} characters"
    if keys > MAX_KEYS:
        return f"models[].keys: at most {MAX_KEYS} keys in all, got {keys}"
    return None


def from_wire(report: v1.PrefixReport) -> Prefixes:
    """A (checked) report's keys; a key given twice for one model merged as in merge()."""
    return merge(
        {m.model: {k.key: (k.size, k.count, k.holder)}} for m in report.models for k in m.keys
    )


def to_wire(prefixes: Prefixes, routers: int) -> v1.PrefixSet:
    return v1.PrefixSet(
        models=[
            v1.ModelPrefixes(
                model=model,
                keys=[
                    v1.PrefixKey(key=key, size=size, count=count, holder=holder)
                    for key, (size, count, holder) in sorted(keys.items())
                ],
            )
            for model, keys in sorted(prefixes.items())
            if keys
        ],
        routers=routers,
    )


class PrefixBook:
    """Each router's last report, and their union (pure: every call is given the time)."""

    def __init__(
        self,
        fresh: float = FRESH,
        max_routers: int = MAX_ROUTERS,
        max_union: int = MAX_UNION,
        recompute: float = RECOMPUTE,
    ) -> None:
        self.fresh = fresh
        self.max_routers = max_routers
        self.max_union = max_union
        self.recompute = recompute
        # router_id -> (when reported, its prefixes); in the order last reported.
        self._reports: dict[str, tuple[float, Prefixes]] = {}
        self._union: Prefixes = {}
        self._union_at: float | None = None
        self._changed = False

    def __len__(self) -> int:
        return len(self._reports)

    def report(self, router_id: str, prefixes: Prefixes, at: float) -> None:
        """Keep ``prefixes`` as ``router_id``'s report (its previous one replaced)."""
        reports = self._reports
        reports.pop(router_id, None)
        while len(reports) >= self.max_routers:
            reports.pop(next(iter(reports)))  # the least recently heard from
        reports[router_id] = (at, prefixes)
        self._changed = True

    def expire(self, at: float) -> None:
        """Forget the reports older than ``fresh``."""
        reports = self._reports
        while reports:
            router_id, (reported, _) = next(iter(reports.items()))
            if reported > at - self.fresh:
                break  # in the order reported: the rest are younger
            del reports[router_id]
            self._changed = True

    def union(self, at: float) -> Prefixes:
        """Every fresh report's prefixes merged (and bounded); computed again at most
        every ``recompute`` seconds."""
        self.expire(at)
        last = self._union_at
        if self._changed and (last is None or at - last >= self.recompute or at < last):
            self._union = bounded(merge(p for _, p in self._reports.values()), self.max_union)
            self._union_at = at
            self._changed = False
        return self._union


RouterCheck = Callable[[grpclib.server.Stream[Any, Any], str], None]


class PrefixShare:
    """The ``SharePrefixes`` handler: a router's report in, the fleet's union out.

    Authenticated as the other router calls (``check_router``: over TLS only a router's
    certificate); served by the leader only (the control plane's leader gate wraps it)."""

    def __init__(
        self,
        check_router: RouterCheck | None = None,
        book: PrefixBook | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.check_router = check_router
        self.book = book if book is not None else PrefixBook()
        self.clock = clock

    def share(self, report: v1.PrefixReport) -> v1.PrefixSet:
        """Take ``report`` and answer the union (INVALID_ARGUMENT naming what is wrong)."""
        problem = report_problem(report)
        if problem is not None:
            raise GRPCError(
                grpclib.const.Status.INVALID_ARGUMENT, f"prefix report refused: {problem}"
            )
        at = self.clock()
        self.book.report(report.router_id, from_wire(report), at)
        return to_wire(self.book.union(at), len(self.book))

    async def _share(self, stream: grpclib.server.Stream[v1.PrefixReport, v1.PrefixSet]) -> None:
        report = await stream.recv_message()
        if report is None:
            raise GRPCError(grpclib.const.Status.INVALID_ARGUMENT, "prefix report refused: empty")
        if self.check_router is not None:
            self.check_router(stream, report.router_id)
        await stream.send_message(self.share(report))

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            "/llmgw.v1.EndpointService/SharePrefixes": grpclib.const.Handler(
                self._share,
                grpclib.const.Cardinality.UNARY_UNARY,
                v1.PrefixReport,
                v1.PrefixSet,
            )
        }
