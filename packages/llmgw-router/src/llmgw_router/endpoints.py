"""Endpoints and the immutable set of them the router serves from.

An :class:`Endpoint` carries both what the control plane (or the config) says about
an engine replica and the router's live view of it (outstanding requests, ejection,
health). An :class:`EndpointSet` is never changed after it is built: a new snapshot
builds a new set and the router swaps it in with one assignment, so a request that
already picked an endpoint keeps that object to the end.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from llmgw_router.outlier import OutlierState

__all__ = ["Endpoint", "EndpointSet", "EndpointSpec"]


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    """What the router is told about one replica."""

    id: str
    url: str
    models: tuple[str, ...]
    profile: str = "static"
    weight: int = 1
    health_path: str = "/health"
    node_id: str = ""
    replica_id: str = ""
    labels: tuple[tuple[str, str], ...] = ()


@dataclass(eq=False, slots=True)
class Endpoint:
    spec: EndpointSpec
    outstanding: int = 0
    outlier: OutlierState = field(default_factory=OutlierState)
    # Active health checks; an endpoint starts healthy so it serves before the first probe.
    healthy: bool = True
    health_failures: int = 0
    health_successes: int = 0
    removed: bool = False

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def weight(self) -> int:
        return self.spec.weight

    @property
    def profile(self) -> str:
        return self.spec.profile

    def usable(self, now: float) -> bool:
        return self.healthy and not self.removed and self.outlier.ejected_until <= now

    def state(self, now: float) -> str:
        if self.removed:
            return "removed"
        if self.outlier.ejected_until > now:
            return "ejected"
        if not self.healthy:
            return "unhealthy"
        return "ready"


class EndpointSet:
    """All endpoints of one snapshot, indexed by served model name."""

    __slots__ = ("_by_model", "endpoints", "source", "version")

    def __init__(
        self, endpoints: Iterable[Endpoint], *, version: int = 0, source: str = ""
    ) -> None:
        self.endpoints: tuple[Endpoint, ...] = tuple(endpoints)
        self.version = version
        self.source = source
        by_model: dict[str, list[Endpoint]] = {}
        for ep in self.endpoints:
            for model in ep.spec.models:
                by_model.setdefault(model, []).append(ep)
        self._by_model: Mapping[str, tuple[Endpoint, ...]] = {
            m: tuple(eps) for m, eps in by_model.items()
        }

    def for_model(self, model: str) -> tuple[Endpoint, ...] | None:
        return self._by_model.get(model)

    @property
    def models(self) -> list[str]:
        return sorted(self._by_model)

    def __len__(self) -> int:
        return len(self.endpoints)

    def successor(self, specs: Iterable[EndpointSpec], *, version: int, source: str) -> EndpointSet:
        """The set for new ``specs``, keeping the live state of endpoints that did not change.

        An endpoint whose id and URL are unchanged is the same object in the new set, so
        its outstanding count and ejection carry over; one that is gone is marked
        removed, and the requests in flight on it still finish there.
        """
        old = {ep.id: ep for ep in self.endpoints}
        kept: list[Endpoint] = []
        for spec in specs:
            prev = old.pop(spec.id, None)
            if prev is not None and prev.spec == spec:
                kept.append(prev)
            elif prev is not None and prev.spec.url == spec.url:
                # Same engine, new attributes (weight, models): the same object, so the
                # requests in flight on it still count against it.
                prev.spec = spec
                kept.append(prev)
            else:
                if prev is not None:
                    prev.removed = True
                kept.append(Endpoint(spec=spec))
        for gone in old.values():
            gone.removed = True
        return EndpointSet(kept, version=version, source=source)
