"""The autoscaler over the fleet: per autoscaled profile, the wanted count and why.

Gathers what :func:`llmgw_control.scaling.autoscale` decides on (ready replicas,
their fresh load figures, routers' demand) from the control plane's records, keeps
each profile's :class:`ScaleState` between passes, and hands the reconciler the
wanted counts. No I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmgw_control.catalog import Catalog
from llmgw_control.loads import Figures
from llmgw_control.records import Replica
from llmgw_control.scaling import LoadSample, ScaleSpec, ScaleState, autoscale

__all__ = ["Autoscaler"]

Key = tuple[str, str]


@dataclass
class Autoscaler:
    states: dict[Key, ScaleState] = field(default_factory=dict)
    reasons: dict[Key, dict[str, Any]] = field(default_factory=dict)

    def wanted(
        self,
        catalog: Catalog,
        replicas: Mapping[str, Replica],
        figures: Callable[[str], tuple[Figures, float] | None],
        demand: Mapping[str, float],
        now: float,
        fresh: float,
    ) -> dict[Key, int]:
        """Wanted counts of the profiles that scale; ``figures(endpoint)`` -> (figures, age)."""
        out: dict[Key, int] = {}
        keys = set()
        for p in catalog.profiles:
            if not (p.autoscaled or p.min_replicas == 0):
                continue
            keys.add(p.key)
            spec = ScaleSpec(
                min=p.min_replicas,
                max=p.max_replicas,
                metric=p.autoscale_metric,
                target=p.autoscale_target,
                up_after=p.up_after,
                down_after=p.down_after,
                idle_after=p.idle_after,
            )
            ready = [
                r
                for r in replicas.values()
                if r.key == p.key and not r.draining and r.ready_since is not None
            ]
            samples = []
            for r in ready:
                got = figures(r.replica_id)
                if got is not None and got[0].known and got[1] <= fresh:
                    f = got[0]
                    samples.append(LoadSample(f.running, f.waiting, f.kv_cache_usage))
            state = self.states.get(p.key)
            if state is None:
                # From what runs (a restart adopts), within the bounds.
                live = sum(1 for r in replicas.values() if r.key == p.key and not r.draining)
                state = ScaleState(wanted=min(max(live, p.min_replicas), p.max_replicas))
            decision = autoscale(
                spec, state, len(ready), samples, now, demand_at=demand.get(p.model)
            )
            self.states[p.key] = decision.state
            out[p.key] = decision.wanted
            self.reasons[p.key] = {
                "min": p.min_replicas,
                "max": p.max_replicas,
                "wanted": decision.wanted,
                "ready": len(ready),
                "metric": p.autoscale_metric,
                "value": None if decision.metric is None else round(decision.metric, 4),
                "target": p.autoscale_target,
                "reason": decision.reason,
            }
        for key in set(self.states) - keys:
            del self.states[key]
            self.reasons.pop(key, None)
        return out
