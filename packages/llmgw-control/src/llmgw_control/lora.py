"""LoRA adapters on the running engines: demand in, load and unload commands out (issue 30).

Routers report each adapter's demand (``ReportDemand`` with the adapter's name as the
model: requests held for want of a holder, and requests received since the last
report). Each pass, :func:`llmgw_control.lora_plan.plan` decides from that demand and
what each ready replica's engine holds (its load reports) which replica loads or
unloads what; the commands go to the replicas' agents, which call the engines' own
runtime APIs and answer with a CommandResult. Loads and unloads are counted
(``llmgw_control_adapter_commands_total``) and shown in status (``adapters``).
"""

from __future__ import annotations

import datetime as dt
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from llmgw_proto import v1
from prometheus_client import CollectorRegistry, Counter

from llmgw_control.catalog import Catalog
from llmgw_control.lora_plan import Action, Demand, ReplicaView, plan
from llmgw_control.publish import EndpointInfo

__all__ = ["LoraManager"]

log = structlog.get_logger(__name__)

# Demand counted over this window for an adapter's rate (or over the time since the first
# report, while that is shorter, but no less than RATE_FLOOR). Three minutes, not one: the
# 9th-16th most used of 40 adapters (Zipf 1.5 at 8 requests a second) are asked for 2-6
# times a minute, too few for a minute's counts to rank them against the rest, and the
# spare pool unloads what ranks last (bench_lora seeds 3 and 4: 89.3 and 89.4 % of
# requests served by a holder with 60 s, 89.7 and 90.7 % with 180 s).
RATE_WINDOW = 180.0
RATE_FLOOR = 10.0
# Held requests are forgotten when no router repeats them for this long.
HELD_TTL = 5.0
# An adapter to unload is first hidden from routers (EndpointLoad.adapters) for this long,
# so that none sends it there any more when the engine lets it go.
UNLOAD_GRACE = 1.5
# A quarter of a base model's adapter slots (at least one; more while the adapters left
# out ask for more turns, lora_plan.pool_size) is the spare pool: the least used adapters,
# the only ones a colder adapter's first requests may evict; the rest stay pinned, so a
# burst of rarely used adapters does not unload the hot ones.
SPARE_SHARE = 0.25
# Requests held this long for an adapter may evict any adapter idle for min_idle.
PATIENCE = 3.0
# A turn in a spare slot: min_idle and this (a load, and its load report).
TURN_EXTRA = 2.0


@dataclass
class _AdapterDemand:
    held: int = 0
    held_at: float = 0.0
    # Since when requests have been held without a break (0: none held).
    held_since: float = 0.0
    last_used: float = 0.0
    # (when, requests) reported within RATE_WINDOW.
    counts: deque[tuple[float, int]] = field(default_factory=deque)

    def view(self, now: float, since: float | None = None) -> Demand:
        """Its demand at ``now``; ``since``: when demand was first reported (the rate is
        over the time since then while that is shorter than the window)."""
        while self.counts and self.counts[0][0] < now - RATE_WINDOW:
            self.counts.popleft()
        held = self.held if now - self.held_at <= HELD_TTL else 0
        span = RATE_WINDOW if since is None else min(RATE_WINDOW, now - since)
        rate = sum(n for _, n in self.counts) / max(RATE_FLOOR, span)
        held_for = now - self.held_since if held and self.held_since else 0.0
        return Demand(held=held, rate=rate, last_used=self.last_used, held_for=held_for)


@dataclass
class _Sent:
    kind: str
    endpoint_id: str
    adapter: str
    model: str
    at: float
    # Answered ok: kept until a load report shows it done (so it is not sent twice).
    answered: bool = False


# (node id, command id, message) for the agents.
Send = Callable[[str, str, v1.ControlMessage], bool]


class LoraManager:
    def __init__(self, registry: CollectorRegistry, *, hot_rate: float = 8.0) -> None:
        self.hot_rate = hot_rate
        self.demand: dict[str, _AdapterDemand] = {}
        # When the first demand report came (rates are over the time since, while shorter
        # than RATE_WINDOW).
        self.since: float | None = None
        self._sent: dict[str, _Sent] = {}
        self._ids = itertools.count(1)
        self.commands = Counter(
            "llmgw_control_adapter_commands",
            "LoRA adapter loads and unloads sent, by model, kind and result.",
            ["model", "kind", "result"],
            registry=registry,
        )
        self.counts: dict[tuple[str, str], int] = {}
        self.errors: dict[str, str] = {}
        # (endpoint id, adapter) -> when it was chosen to go: hidden, unloaded after the grace.
        self._leaving: dict[tuple[str, str], float] = {}
        # Tells routers an endpoint's adapters again (LoadBook.touch_endpoint).
        self.touch: Callable[[str], None] = lambda endpoint_id: None

    def hidden(self, endpoint_id: str) -> frozenset[str]:
        """Adapters routers are not told the endpoint holds: leaving, or being unloaded."""
        out = {a for (e, a) in self._leaving if e == endpoint_id}
        out.update(
            s.adapter
            for s in self._sent.values()
            if s.endpoint_id == endpoint_id and s.kind == "unload"
        )
        return frozenset(out)

    # --- from routers ---------------------------------------------------------------

    def on_demand(self, adapter: str, held: int, requests: int, now: float) -> None:
        if self.since is None:
            self.since = now
        d = self.demand.setdefault(adapter, _AdapterDemand())
        if not held:
            d.held_since = 0.0
        elif not d.held_since or not d.held or now - d.held_at > HELD_TTL:
            d.held_since = now
        d.held, d.held_at = held, now
        if requests:
            d.counts.append((now, requests))
        if held or requests:
            d.last_used = now

    # --- from agents ----------------------------------------------------------------

    def on_result(self, command_id: str, ok: bool, error: str) -> bool:
        """A CommandResult: True when it answered one of this manager's commands."""
        sent = self._sent.get(command_id)
        if sent is None or sent.answered:
            return False
        if ok:
            sent.answered = True
        else:
            del self._sent[command_id]
        result = "ok" if ok else "error"
        self.commands.labels(sent.model, sent.kind, result).inc()
        key = (sent.kind, result)
        self.counts[key] = self.counts.get(key, 0) + 1
        if ok:
            self.errors.pop(sent.adapter, None)
            log.info("adapter " + sent.kind + "ed", adapter=sent.adapter, endpoint=sent.endpoint_id)
        else:
            self.errors[sent.adapter] = f"{sent.kind} on {sent.endpoint_id}: {error}"
            log.warning(
                "adapter " + sent.kind + " failed",
                adapter=sent.adapter,
                endpoint=sent.endpoint_id,
                error=error,
            )
        return True

    # --- each pass --------------------------------------------------------------------

    def step(
        self,
        catalog: Catalog,
        endpoints: Sequence[EndpointInfo],
        held_by: Callable[[str], tuple[frozenset[str], float] | None],
        send: Send,
        now: float,
        expire: float = 60.0,
        prefix: str = "lora",
    ) -> list[Action]:
        """Plan and send for every model with adapters; the actions sent."""
        for cid, s in list(self._sent.items()):
            found = held_by(s.endpoint_id)
            held = found[0] if found is not None else frozenset()
            seen = (s.adapter in held) == (s.kind == "load")
            # Done once the engine's load report shows it; forgotten if it never does.
            if (s.answered and seen) or now - s.at > expire:
                del self._sent[cid]
        by_id = {ep.id: ep for ep in endpoints}
        sent_all: list[Action] = []
        # Unloads whose grace is over go out now (the routers stopped sending there).
        for (endpoint_id, adapter), since in list(self._leaving.items()):
            ep = by_id.get(endpoint_id)
            if ep is None:
                del self._leaving[(endpoint_id, adapter)]
                continue
            if now - since < UNLOAD_GRACE:
                continue
            if not self._send(ep, Action("unload", endpoint_id, adapter), "", send, now, prefix):
                break
            del self._leaving[(endpoint_id, adapter)]
            sent_all.append(Action("unload", endpoint_id, adapter))
        for model in dict.fromkeys(p.model for p in catalog.profiles if p.max_loras > 0):
            names = {a.name: a for a in catalog.adapters_of(model)}
            views: list[ReplicaView] = []
            removed: list[Action] = []
            # An adapter used within this is not unloaded for another (lora.min_idle).
            min_idle = max(
                (p.lora_min_idle for p in catalog.of_model(model) if p.max_loras > 0), default=10.0
            )
            for ep in endpoints:
                profile = catalog.get(ep.model, ep.profile)
                if ep.model != model or profile is None or profile.max_loras <= 0:
                    continue
                found = held_by(ep.id)
                held, load = found if found is not None else (frozenset(), 0.0)
                loading = frozenset(
                    s.adapter
                    for s in self._sent.values()
                    if s.endpoint_id == ep.id and s.kind == "load"
                )
                going = self.hidden(ep.id)
                views.append(
                    ReplicaView(
                        ep.id, load, profile.max_loras, (held - going) & frozenset(names), loading
                    )
                )
                # Adapters no longer in the catalog (a reload removed them) are unloaded.
                removed += [Action("unload", ep.id, a) for a in sorted(held - going - set(names))]
            demand = {a: d.view(now, self.since) for a, d in self.demand.items() if a in names}
            spare = max(1, int(SPARE_SHARE * sum(v.capacity for v in views)))
            actions = plan(
                views,
                demand,
                hot_rate=self.hot_rate,
                now=now,
                min_idle=min_idle,
                patience=PATIENCE,
                spare=spare,
                turn=min_idle + TURN_EXTRA,
            )
            for action in [*removed, *actions]:
                ep = by_id[action.replica]
                key = (action.replica, action.adapter)
                if action.kind == "unload":
                    # Hidden from routers first; unloaded once the grace is over.
                    self._leaving[key] = now
                    self.touch(action.replica)
                    log.info("adapter leaving", adapter=action.adapter, endpoint=action.replica)
                    continue
                if key in self._leaving:
                    # Wanted again where it is still loaded: it stays.
                    del self._leaving[key]
                    self.touch(action.replica)
                    continue
                source = names[action.adapter].source
                if not self._send(ep, action, source, send, now, prefix, model):
                    break
                sent_all.append(action)
        return sent_all

    def _send(
        self,
        ep: EndpointInfo,
        action: Action,
        source: str,
        send: Send,
        now: float,
        prefix: str,
        model: str = "",
    ) -> bool:
        command_id = f"{prefix}-{next(self._ids)}"
        if action.kind == "load":
            msg = v1.ControlMessage(
                load_adapter=v1.LoadAdapter(
                    command_id=command_id, shard_id=ep.shard_id, name=action.adapter, source=source
                )
            )
        else:
            msg = v1.ControlMessage(
                unload_adapter=v1.UnloadAdapter(
                    command_id=command_id, shard_id=ep.shard_id, name=action.adapter
                )
            )
        if not send(ep.node_id, command_id, msg):
            return False
        self._sent[command_id] = _Sent(action.kind, ep.id, action.adapter, model or ep.model, now)
        log.info(
            "adapter command sent",
            kind=action.kind,
            adapter=action.adapter,
            endpoint=ep.id,
            command_id=command_id,
        )
        return True

    def status(
        self,
        catalog: Catalog,
        endpoints: Sequence[EndpointInfo],
        held_by: Callable[[str], tuple[frozenset[str], float] | None],
        now: float,
    ) -> dict[str, Any]:
        """What status shows: each adapter's holders and demand, and the counts."""
        adapters: dict[str, Any] = {}
        for a in catalog.adapters:
            holders = [
                ep.id
                for ep in endpoints
                if ep.model == a.model and a.name in (held_by(ep.id) or (frozenset(), 0.0))[0]
            ]
            d = self.demand.get(a.name)
            view = d.view(now, self.since) if d is not None else Demand()
            adapters[a.name] = {
                "model": a.model,
                "source": a.source,
                "holders": holders,
                "held_requests": view.held,
                "rate": round(view.rate, 3),
                "loading": sorted(
                    s.endpoint_id
                    for s in self._sent.values()
                    if s.adapter == a.name and s.kind == "load"
                ),
                "last_error": self.errors.get(a.name, ""),
            }
        return {
            "adapters": adapters,
            "loads": self.counts.get(("load", "ok"), 0),
            "load_failures": self.counts.get(("load", "error"), 0),
            "unloads": self.counts.get(("unload", "ok"), 0),
            "unload_failures": self.counts.get(("unload", "error"), 0),
            "at": dt.datetime.now(dt.UTC).isoformat(),
        }


def render_adapters(
    data: dict[str, Any], table: Callable[[list[list[str]], list[str]], str]
) -> list[str]:
    """`llmgw-control status`'s LoRA table (none without adapters): each adapter's holders,
    demand and last error, and the loads and unloads so far. ``data`` is escaped already."""
    lora = data.get("lora")
    if not lora:
        return []
    rows = [
        [
            name,
            a["model"],
            ",".join(a["holders"]) or "-",
            ",".join(a["loading"]) or "-",
            str(a["held_requests"]),
            f"{a['rate']:g}/s",
            a["last_error"] or "-",
        ]
        for name, a in sorted(lora["adapters"].items())
    ]
    header = ["ADAPTER", "MODEL", "HOLDERS", "LOADING", "HELD", "RATE", "LAST ERROR"]
    counts = (
        f"adapter loads {lora['loads']} ({lora['load_failures']} failed), "
        f"unloads {lora['unloads']} ({lora['unload_failures']} failed)"
    )
    return [table(rows, header) + "\n" + counts]
