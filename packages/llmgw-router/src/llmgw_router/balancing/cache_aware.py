"""The cache-aware balancer: prefix affinity bounded by load (the default)."""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from llmgw_router.balancing.base import Balancer, L, Pick
from llmgw_router.balancing.index import MASK, FirstSeen, PrefixIndex, endpoint_ident
from llmgw_router.balancing.model import cache_room, engine_matches, load_order, ttft_costs
from llmgw_router.balancing.placement import balanced_home, place

__all__ = ["CacheAware"]


class CacheAware(Balancer[L]):
    """Prefix affinity bounded by load: the default balancer.

    - Affinity: the request's prefix blocks (chained hashes of its prompt, see prefix.py)
      rank the endpoints by rendezvous hashing of the block at depth ``affinity_blocks``
      (or the last, for shorter prompts), so routers that never talk agree on where a
      prefix goes. What this router itself sent refines that: endpoints that were sent
      more of this prefix than the rendezvous block covers (its holders) rank first, the
      longer match first, equals in rendezvous order (so a prefix stays where it is).
      A prefix sent nowhere yet goes to its home whatever the loads (within the bound):
      with ``shared_homes`` the shared rule's (below), so every router places it alike (a
      load-dependent first placement had four routers cache a tenant on two engines);
      without, its first rendezvous choice under its share of this router's recent
      prefixes (placement.balanced_home: rendezvous alone gave an engine 11 of 32). Where
      over 3 in 4 recent picks carried distinct prefixes (nothing recurs), the least
      loaded endpoint of all. A prefix held only away from its home (it spilled there)
      goes back once home is no more loaded than the holder.
    - Demand: the share ``s`` of this router's last ``window`` picks that carried the
      prefix's rendezvous block. A prefix wants one endpoint per half an endpoint's fair
      share, ``need = ceil(2 * s * n / (1 + epsilon))`` of the ``n`` endpoints; where
      ``need > 1`` it spreads over its first ``need`` rendezvous choices and its holders,
      the least loaded of them first (equals in turn): one hot prefix spreads over as
      many replicas as its load needs, in the same order on every router. (Half, not a
      whole share: an engine that takes a whole fair share from one prefix is busy with
      it nearly all the time, and its requests wait for its steps while other engines
      idle; with Zipf-skewed tenants the top one, a quarter of the picks over 4 engines,
      kept one engine busy while others idled.)
    - Load: each candidate's ``load`` (the engine's running + waiting requests and KV use
      when read, corrected by this router's sends and completions since; or this router's
      own in-flight count when the engine's figures are unknown or stale). Where load
      alone decides (a hot prefix's spread, prompts that share nothing), ``awaiting_first``
      comes first: this router's requests there still without a first byte (queued or in
      prefill, what a new request's first token waits behind).
    - Bounded load: the first endpoint of that ranking takes the request when its load,
      with this request, stays within ``ceil((1 + epsilon) * (total + 1) * weight /
      total_weight) + slack * weight / mean_weight``; the absolute ``slack`` (requests)
      keeps affinity at the small in-flight counts where one request more is already 25 %
      over the mean. The bound counts requests: the KV-cache fraction of a load orders
      endpoints but never tips one over. Over the bound, the least loaded holder within
      it takes the request (a cache hit still), else the next endpoint of the ranking
      within it (rendezvous order: every router spills a prefix to the same second home,
      which then holds it), else the least loaded.
    - Capacity: where an engine's cache size is known (``cache_blocks``, in prefix
      blocks), what this router remembers sending there is an LRU of that size (what it
      drops, the engine has most likely evicted: a prefix that no longer fits is no
      longer counted as held), and a new prefix's home is the first with room for it
      beside its live prefixes (blocks sent within the last ``window`` picks).
    - Shared homes (``shared_homes``, for several routers in front of one fleet): where
      the cache sizes are known, a prefix's home is given by a shared rule
      (placement.place): a stable matching of the prefixes of this router's last
      ``window`` picks (each by its rendezvous block and its size, what its last two
      prompts share) to the endpoints, within each cache less an eighth (left for the
      requests in flight). Its inputs are what every router of a fleet has alike, not
      this router's sends or loads (first come first placed had routers that saw the
      tenants in other orders disagree). A prefix held elsewhere is not moved to a home
      that changed (a move is a miss) until this router's record of its holder dropped
      it. Behind a control plane the routers share their recent prefixes (share_keys,
      SharePrefixes): a prefix the fleet sent somewhere keeps its home where most of its
      requests went while what is held there fits, and the rest are placed over the
      union of every router's: routers agree.
    - Predicted time to first token: per candidate, ``block_time * (pending + miss) +
      block_time * evicted``: the prefill queued there, the prompt's blocks it does not
      hold, and the live blocks of other prefixes this one would push out of a full cache
      (each a prefill again later). Within the bound, another endpoint takes a held
      prefix's request from its holder only where its prediction is lower by more than
      the extra prefill the move puts in its queue, and only among those with room where
      the holder has room: a holder keeps its prefix until its queue costs more than
      twice the prefill elsewhere. A new prefix is never placed by the predictions.
    - Without a prefix (embeddings), the least loaded takes it.

    Every pick returns its reason (:data:`REASONS`) and the prompt's blocks the chosen
    engine is predicted to prefill (``Pick.miss``).

    An endpoint whose ``generation`` changes (a restarted engine) loses its prefix history.
    """

    def __init__(
        self,
        *,
        epsilon: float = 0.25,
        slack: float = 3.0,
        affinity_blocks: int = 8,
        index_blocks: int = 16384,
        window: int = 256,
        block_time: float = 0.0064,
        rng: random.Random | None = None,
        shared_homes: bool = False,
        use_slots: bool = True,
        fit_holders: bool = True,
    ) -> None:
        self.epsilon = epsilon
        self.fit_holders = fit_holders  # see placement.place's fit
        self.use_slots = use_slots
        # The order endpoints were first ranked in: of two in one slot, the older first.
        self._born = FirstSeen()
        self.shared_homes = shared_homes
        # The prior for a candidate that has no learned rate: seconds per prefix block.
        self.block_time = block_time
        self._tick = 0
        self.slack = slack
        self.affinity_blocks = affinity_blocks
        self.index_blocks = index_blocks
        self.window = max(1, window)
        self.rng = rng or random.Random()
        self._indexes: dict[str, PrefixIndex] = {}
        self._turn = 0
        self._recent: deque[int] = deque()
        self._recent_counts: dict[int, int] = {}
        # Picks where the engines' reported caches named the holders (precise matching).
        self.engine_cache_picks = 0
        # The shared placement rule (placement.place): each recent prefix's size in
        # blocks, and the homes computed for the last inputs (None: compute again).
        self._sizes: dict[int, int] = {}
        self._last: dict[int, Sequence[int]] = {}
        self._ranks: dict[int, list[tuple[int, float]]] = {}
        self._homes: dict[int, int] | None = None
        self._homes_for: tuple[tuple[str, int, int], ...] = ()
        self._keys_version = 0
        self._homes_version = -1
        # The fleet's recent prefixes (share_keys: every router's, through the control
        # plane): key -> (size in blocks, 0 where not known; count; the endpoint the
        # routers sent most of it to, "" where none); and where this router last sent
        # each of its recent prefixes (shared_homes only).
        self._fleet: dict[int, tuple[int, int, str]] = {}
        self._sent_to: dict[int, str] = {}
        # Without shared_homes: each recent prefix's home (an endpoint id, see
        # _balanced) while it stays in the window, and how many are homed on each.
        self._placed: dict[int, str] = {}
        self._homed: dict[str, int] = {}

    # -------------------------------------------------------------- prefix state

    def forget(self, endpoint_id: str) -> None:
        self._indexes.pop(endpoint_id, None)

    def remembered(self, endpoint_id: str) -> int:
        index = self._indexes.get(endpoint_id)
        return len(index.blocks) if index is not None else 0

    def _index(self, c: L) -> PrefixIndex | None:
        index = self._indexes.get(c.id)
        if index is not None and index.generation != c.generation:
            del self._indexes[c.id]
            return None
        return index

    def matched(self, c: L, prefix: Sequence[int]) -> int:
        """Leading blocks of ``prefix`` this router sent to ``c`` (its current engine)."""
        index = self._index(c)
        return index.match(prefix) if index is not None else 0

    def _record(self, c: L, prefix: Sequence[int]) -> None:
        if not prefix or self.index_blocks <= 0:
            return
        index = self._index(c)
        if index is None:
            if len(self._indexes) >= 4096:
                # Endpoints come and go; the oldest entry is the likeliest to be gone.
                self._indexes.pop(next(iter(self._indexes)))
            index = self._indexes[c.id] = PrefixIndex(c.generation)
        self._tick += 1
        capacity = c.cache_blocks
        limit = min(self.index_blocks, capacity) if capacity > 0 else self.index_blocks
        index.record(prefix, max(1, limit), self._tick)
        if self.shared_homes:
            sent = self._sent_to
            sent[prefix[min(len(prefix), self.affinity_blocks) - 1]] = c.id
            if len(sent) > 2 * self.window:  # bounded without a control plane to read it
                recent = self._recent_counts
                self._sent_to = {k: e for k, e in sent.items() if k in recent}

    def footprint(self, c: L) -> int:
        """Prefix blocks this router sent to ``c`` within the last ``window`` picks and
        still in its (modelled) cache: its live prefixes."""
        index = self._index(c)
        return index.footprint(self._tick - self.window + 1) if index is not None else 0

    def share(self, key: int) -> float:
        """The share of the recent picks (this one included) whose rendezvous block is ``key``."""
        recent, counts = self._recent, self._recent_counts
        recent.append(key)
        seen = counts.get(key, 0)
        counts[key] = seen + 1
        if not seen:
            self._keys_version += 1
        if len(recent) > self.window:
            old = recent.popleft()
            left = counts[old] - 1
            if left:
                counts[old] = left
            else:
                del counts[old]
                self._set_home(old, None)
                self._keys_version += 1
        # Until the window fills, as if the rest of it were other prefixes (32 at least:
        # twice the floor of a whole share, as `need` counts half shares), so the first
        # requests of a run do not all look hot.
        return counts[key] / max(len(recent), min(32, self.window))

    # -------------------------------------------------------------- the pick

    def ranking(self, ready: Sequence[L], prefix: Sequence[int]) -> list[L]:
        """``ready`` in rendezvous order for ``prefix`` (no load); without shared_homes,
        the home this router gives it first (see _balanced: this router's own record)."""
        key = prefix[min(len(prefix), self.affinity_blocks) - 1]
        order = self._rendezvous(ready, key)
        if not self.shared_homes and not self._mostly_distinct():
            home = self._balanced(ready, [max(1, c.weight) for c in ready], key, order)[0]
            order.remove(home)
            order.insert(0, home)
        return [ready[i] for i in order]

    def _rendezvous(self, ready: Sequence[L], key: int) -> list[int]:
        return [i for i, _ in self._scored(ready, key)]

    def _scored(self, ready: Sequence[L], key: int) -> list[tuple[int, float]]:
        """``ready``'s positions in rendezvous order for ``key``, each with its score."""
        weights = [c.weight for c in ready]
        uniform = all(w == weights[0] for w in weights)
        scored: list[tuple[float, int, int]] = []
        born = self._born.order(ready)
        for i, c in enumerate(ready):
            # The endpoint's slot where set (a replacement ranks where its predecessor
            # did, after it while both serve), else its id. splitmix64 of it and the block.
            slot = c.slot if self.use_slots else ""
            x = ((key ^ endpoint_ident(slot or c.id)) + 0x9E3779B97F4A7C15) & MASK
            x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
            x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
            mixed = x ^ (x >> 31)
            # Weighted rendezvous: weight / -ln(u); at equal weights the order of u is enough.
            score = (
                float(mixed) if uniform else max(1, c.weight) / -math.log((mixed + 1) / (2**64 + 2))
            )
            scored.append((score, -born.setdefault(c.id, len(born)), i))
        scored.sort(reverse=True)
        return [(r[2], r[0]) for r in scored]

    def _home(self, ready: Sequence[L], key: int, prefix: Sequence[int]) -> int | None:
        """The shared placement rule's home (a position in ``ready``) for the prefix whose
        rendezvous block is ``key`` (placement.place over the prefixes of this router's
        last ``window`` picks and the fleet's, see share_keys); None where no engine's
        cache size is known."""
        capacities = [c.cache_blocks for c in ready]
        if not any(capacities):
            return None
        # An eighth of each cache is left for the requests in flight and their own
        # (unshared) blocks, which push the least recently used prefixes out too.
        whole, capacities = capacities, [cap - cap // 8 for cap in capacities]
        inputs = tuple((c.id, c.weight, cap) for c, cap in zip(ready, capacities, strict=True))
        if inputs != self._homes_for:
            self._ranks.clear()
            self._homes = None
        size = self._size(key, prefix)
        sizes = self._sizes
        if sizes.get(key) != size:
            sizes[key] = size
            self._homes = None
        homes = self._homes
        if homes is None or key not in homes or self._homes_version != self._keys_version:
            fleet = self._fleet
            keys = set(self._recent_counts)
            keys.add(key)
            for gone in [k for k in sizes if k not in keys]:
                del sizes[gone]
                self._last.pop(gone, None)
            keys.update(fleet)
            ranks = self._ranks
            for gone in [k for k in ranks if k not in keys]:
                del ranks[gone]
            for k in keys:
                if k not in ranks:
                    ranks[k] = self._scored(ready, k)
            # The fleet's size where it knows one (every router then places a prefix by
            # the same size), this router's own where not.
            placed = (
                {**sizes, **{k: v[0] for k, v in fleet.items() if v[0] > 0}} if fleet else sizes
            )
            # Where the fleet's routers sent a prefix (most of its requests): its holder,
            # its home while what the holder holds fits there (placement.place).
            at = {c.id: i for i, c in enumerate(ready)}
            held = {k: at[v[2]] for k, v in fleet.items() if v[2] in at}
            homes = place(ranks, placed, capacities, held, fit=self.fit_holders, whole=whole)
            self._homes, self._homes_for = homes, inputs
            self._homes_version = self._keys_version
        return homes[key]

    def _size(self, key: int, prefix: Sequence[int]) -> int:
        """A prefix's size for the placement rule, in blocks: what its last two prompts
        (``prefix`` and the one before it with this rendezvous block) share, the whole
        prompt the first time; rounded up to 4 blocks. The same on every router that saw
        two such prompts, whatever their own tails."""
        last = self._last.get(key)
        self._last[key] = prefix
        common = len(prefix)
        if last is not None:
            common = 0
            for a, b in zip(last, prefix, strict=False):  # the shorter decides
                if a != b:
                    break
                common += 1
        return -(-max(1, common) // 4) * 4

    def recent_keys(self) -> dict[int, tuple[int, int, str]]:
        """The prefixes of this router's last ``window`` picks, for the fleet (the control
        plane's SharePrefixes): key -> (size in blocks, 0 where not known yet; count;
        the endpoint this router last sent it to, "" where not known)."""
        sizes, recent = self._sizes, self._recent_counts
        sent = self._sent_to = {k: e for k, e in self._sent_to.items() if k in recent}
        return {k: (sizes.get(k, 0), n, sent.get(k, "")) for k, n in recent.items()}

    def fleet_keys(self) -> Mapping[int, tuple[int, int, str]]:
        """The fleet's keys last given to share_keys."""
        return self._fleet

    def share_keys(self, keys: Mapping[int, tuple[int, int, str]]) -> None:
        """The fleet's recent prefixes (key -> (size, count, holder), every router's
        merged by the control plane; empty: none, or no longer known). With
        ``shared_homes`` a prefix the fleet holds has its home there, and the others are
        placed over this router's own recent prefixes and these, so that routers that
        each see a part of the traffic give each prefix the same home."""
        fleet, was = dict(keys), self._fleet
        self._fleet = fleet
        # The homes depend on the keys, their sizes and holders, not on the counts.
        if fleet.keys() != was.keys() or any(fleet[k][::2] != was[k][::2] for k in fleet):
            self._keys_version += 1
            self._homes = None

    def _matches(
        self, ready: Sequence[L], prefix: Sequence[int], depth: int
    ) -> tuple[list[int], list[int]]:
        """Per candidate: leading blocks of ``prefix`` sent there, 0 when no more than the
        rendezvous block covers (there hashing decides); and the same without that floor."""
        out = [0] * len(ready)
        raw = [0] * len(ready)
        indexes = self._indexes
        for i, c in enumerate(ready):
            index = indexes.get(c.id)
            if index is None:
                continue
            if index.generation != c.generation:
                del indexes[c.id]
                continue
            match = raw[i] = index.match(prefix)
            if match > depth:
                out[i] = match
        return out, raw

    def bound(self, load_total: float, weight: int, weight_total: int, n: int) -> float:
        """The most load an endpoint of ``weight`` may have with this request on it."""
        share = (load_total + 1.0) * weight / weight_total
        return math.ceil((1.0 + self.epsilon) * share) + self.slack * weight * n / weight_total

    def choose(
        self,
        candidates: Sequence[L],
        usable: Callable[[L], bool],
        key: str | None,
        prefix: Sequence[int] = (),
        cached: Callable[[L], int] | None = None,
        *,
        at: float,
    ) -> Pick[L]:
        ready = [c for c in candidates if usable(c)]
        if not ready:
            return Pick(None, "none")
        miss = 0
        if len(ready) == 1:
            chosen, reason = ready[0], "only"
            if prefix:
                miss = len(prefix) - self.matched(chosen, prefix)
        elif prefix:
            i, reason, miss = self._pick_prefix(ready, prefix, cached, at)
            chosen = ready[i]
        else:
            per_load = [c.load_at(at) / max(1, c.weight) for c in ready]
            least = min(per_load)
            chosen = self.rng.choice(
                [c for c, load in zip(ready, per_load, strict=True) if load == least]
            )
            reason = "least_loaded"
        self._record(chosen, prefix)
        return Pick(chosen, reason, miss)

    def _pick_prefix(
        self,
        ready: Sequence[L],
        prefix: Sequence[int],
        cached: Callable[[L], int] | None,
        now: float,
    ) -> tuple[int, str, int]:
        """The chosen candidate's position, why, and its predicted prefill in blocks."""
        n = len(ready)
        size = len(prefix)
        loads = [c.load_at(now) for c in ready]
        weights = [max(1, c.weight) for c in ready]
        per_load = [load / w for load, w in zip(loads, weights, strict=True)]
        depth = min(len(prefix), self.affinity_blocks)
        block = prefix[depth - 1]
        self._turn += 1
        order = self._rendezvous(ready, block)
        first_choice = order[0]
        distinct = self._mostly_distinct()
        home_at = self._home(ready, block, prefix) if self.shared_homes and not distinct else None
        under: list[bool] = []
        placed: int | None = None
        if not self.shared_homes and not distinct:
            home_at, under, placed = self._balanced(ready, weights, block, order)
        if home_at is not None and home_at != first_choice:
            order.remove(home_at)
            order.insert(0, home_at)
        # Precise: where the engines report their caches and one holds more of this
        # prompt than the others, that is what holds it; else what this router sent.
        engine: list[int] | None = None
        if cached is not None:
            engine, held = engine_matches(ready, cached)
        if engine is not None:
            self.engine_cache_picks += 1
            match = engine
        else:
            match, held = self._matches(ready, prefix, depth)
        miss = [size - min(size, h) for h in held]
        # Holders: the longer match first, equals in rendezvous order (sort is stable).
        holders = sorted((i for i in order if match[i]), key=lambda i: -match[i])
        # A home the fleet agreed on (fit_holders) that holds it: this router's copies
        # elsewhere are no holders (a send there keeps a copy other homes need room for).
        fleet_home = self.fit_holders and home_at is not None and block in self._fleet
        if fleet_home and engine is None and home_at is not None and match[home_at]:
            for i in holders:
                match[i], miss[i] = (match[i], miss[i]) if i == home_at else (0, size)
            holders = [home_at]
        need = min(n, math.ceil(2.0 * self.share(block) * n / (1.0 + self.epsilon) - 1e-9))
        room: list[int | None] | None = None
        new = False
        if need > 1:
            # A hot prefix: its first `need` rendezvous choices and its holders, least
            # loaded first, equals in turn (a counter: two routers with one history agree).
            group = set(order[:need]).union(holders)
            queue = load_order(ready, weights, per_load)
            spread = sorted((i for i in order if i in group), key=queue.__getitem__)
            tied = [i for i in spread if queue[i] == queue[spread[0]]]
            turn = self._turn % len(tied)
            ranking = tied[turn:] + tied[:turn] + spread[len(tied) :]
            ranking += [i for i in order if i not in group]
            reason = "hot_spread"
        else:
            rest = [i for i in order if not match[i]]
            if not holders:
                # A prefix this router has not sent anywhere yet: its home, whatever the
                # loads (the bound and the predicted times below aside). Where prompts
                # share nothing (nothing recurs): the least loaded first.
                if distinct:
                    rest.sort(key=load_order(ready, weights, per_load).__getitem__)
                    ranking, reason = rest, "distinct"
                else:
                    if under:
                        # Its home first, then in rendezvous order: first those with room
                        # for it and under their share of the recent prefixes, then those
                        # with room, then those under their share.
                        room = cache_room(ready, self.footprint)
                        fits = {i for i in rest if (free := room[i]) is None or free >= miss[i]}
                        rest.sort(key=lambda i: (i not in fits, not under[i] and i != home_at))
                        self._set_home(block, ready[rest[0]].id)
                    ranking = rest
                    reason = "rendezvous" if ranking[0] == first_choice else "capacity"
                    # Not shared_homes: "balance" where its first choice has room.
                    free = room[first_choice] if reason == "capacity" and room else -1
                    if free is None or free >= miss[first_choice]:
                        reason = "balance"
                    new = True
            elif (
                engine is None
                and not match[home := order[0]]
                and per_load[home] <= per_load[holders[0]]
                and (
                    fleet_home
                    or (free := (room := cache_room(ready, self.footprint))[home]) is None
                    or free >= miss[home]
                )
            ):
                # Held elsewhere but not at its home (it spilled when home was over the
                # bound, another router sent it there, an endpoint under its share
                # joined): home again once home is no more loaded than the holder, so
                # routers converge and the copies elsewhere age out. Not where the
                # engines report their caches (every router sees one holder), nor where
                # home has no room in this router's record, unless the fleet's rule
                # (every router's prefixes) gave that home.
                ranking = [home, *holders, *(i for i in rest if i != home)]
                reason = "home_again"
                if under:
                    self._set_home(block, ready[home].id)
            else:
                ranking = holders + rest
                reason = "engine_cache" if engine is not None else "holder"
                if under and placed is None:  # held, with no home: the holder is home
                    self._set_home(block, ready[holders[0]].id)
        total = sum(loads)
        weight_total = sum(weights)
        first = ranking[0]
        if self.within(loads[first], total, weights[first], weight_total, n):
            if new or reason in ("hot_spread", "distinct", "home_again"):
                # Rules, not queues (a new prefix's home, a hot prefix's spread, the way
                # home) or nothing recurs. (Placing a new prefix by this router's queues
                # had 4 routers at 62-73 % hits in a tight cache, against 77-88 %.)
                return first, reason, miss[first]
            # Predicted time to first token: another endpoint within the bound takes a
            # held prefix where it would answer sooner by more than the move costs
            # besides: the extra prefill it puts in that endpoint's queue (what comes
            # after it there waits for it too); among those with room for it where the
            # first has room.
            if room is None:
                room = cache_room(ready, self.footprint)
            costs = ttft_costs(ready, miss, room, now, self.block_time)
            first_fits = (free := room[first]) is None or free >= miss[first]
            best, best_cost = first, costs[first]
            for i in ranking:
                if i == first or not self.within(loads[i], total, weights[i], weight_total, n):
                    continue
                if first_fits and (free := room[i]) is not None and free < miss[i]:
                    continue
                rate = ready[i].block_time
                extra = max(0, miss[i] - miss[first])
                cost = costs[i] + (rate if rate > 0 else self.block_time) * extra
                if cost < best_cost:
                    best, best_cost = i, cost
            if best != first:
                return best, "predicted_ttft", miss[best]
            return first, reason, miss[first]
        # Over the bound: the least loaded holder within it (the prefix is cached there),
        # else the next of the ranking within it (in rendezvous order, so every router
        # spills a prefix to the same second home, which then holds it), else the least
        # loaded of all; ties go to the earlier in the ranking.
        within = [i for i in ranking if self.within(loads[i], total, weights[i], weight_total, n)]
        held_within = [i for i in within if match[i]]
        if held_within:
            at = min(held_within, key=per_load.__getitem__)
            return at, "bound_holder", miss[at]
        if within:
            return within[0], "bound_spill", miss[within[0]]
        at = min(ranking, key=per_load.__getitem__)
        return at, "bound_least_loaded", miss[at]

    def _balanced(
        self, ready: Sequence[L], weights: Sequence[int], key: int, order: Sequence[int]
    ) -> tuple[int, list[bool], int | None]:
        """Without shared_homes: the prefix's home (placement.balanced_home over the
        homes this router gave its recent prefixes: the one it has, or one it ranks
        higher under its share), which candidates are under their share, and the home
        it has (None: none among ``ready``)."""
        placed = self._placed.get(key)
        current = next((i for i, c in enumerate(ready) if c.id == placed), None)
        homed = [self._homed.get(c.id, 0) for c in ready]
        if current is not None:
            homed[current] -= 1
        return (*balanced_home(order, homed, weights, current), current)

    def _set_home(self, key: int, endpoint_id: str | None) -> None:
        """Record (or, with None, drop) the home this router gave a prefix."""
        homed = self._homed
        old = self._placed.pop(key, None)
        if old is not None:
            if (left := homed[old] - 1) > 0:
                homed[old] = left
            else:
                del homed[old]
        if endpoint_id is not None:
            self._placed[key] = endpoint_id
            homed[endpoint_id] = homed.get(endpoint_id, 0) + 1

    def _mostly_distinct(self) -> bool:
        """Whether over 3 in 4 of the recent picks carried distinct prefixes (once the
        window is a quarter full): prompts that share nothing, where a new one will not
        recur and only load matters."""
        recent = len(self._recent)
        return recent >= self.window // 4 and 4 * len(self._recent_counts) > 3 * recent

    def within(
        self, load: float, load_total: float, weight: int, weight_total: int, n: int
    ) -> bool:
        """Whether an endpoint of ``load`` stays within the bound with one more request.

        The bound counts requests: a load's fraction (the engine's KV-cache use, 0..1)
        orders endpoints with as many requests, but never pushes one over the bound."""
        return math.floor(load) + 1.0 <= self.bound(load_total, weight, weight_total, n)
