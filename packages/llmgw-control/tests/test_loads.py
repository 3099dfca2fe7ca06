"""LoadBook, pure: a router that applies its updates holds what a new subscriber is given."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from llmgw_control.loads import LoadBook
from llmgw_proto import v1

SHARDS = ["s0", "s1", "s2"]

events = st.one_of(
    st.tuples(
        st.just("report"),
        st.sampled_from(SHARDS),
        st.integers(0, 20),
        st.integers(0, 3),  # agent generation
    ),
    st.tuples(
        st.just("cache"),
        st.sampled_from(SHARDS),
        st.sets(st.integers(0, 30), max_size=4),
        st.sets(st.integers(0, 30), max_size=4),
        st.booleans(),
        st.booleans(),  # named by token ids
    ),
    st.tuples(
        st.just("publish"),
        st.dictionaries(st.sampled_from(["e0", "e1", "e2"]), st.sampled_from(SHARDS)),
    ),
    st.tuples(st.just("take")),
)


def apply(view: dict[str, Any], update: v1.LoadUpdate) -> None:
    """What a router does with an update: loads by endpoint, blocks by endpoint."""
    if update.full:
        view.clear()
    for load in update.loads:
        entry = view.setdefault(load.endpoint_id, {"blocks": set()})
        entry["load"] = (load.known, load.waiting, load.generation)
        if not load.known and load.generation == 0:
            view.pop(load.endpoint_id)  # gone
    for cache in update.caches:
        entry = view.setdefault(cache.endpoint_id, {"blocks": set()})
        if cache.cleared:
            entry["blocks"] = set()
        entry["blocks"] -= set(cache.removed)
        entry["blocks"] |= set(cache.stored)
        if cache.cleared or cache.stored:
            entry["token_hashes"] = cache.token_hashes
        if not entry["blocks"]:
            entry.pop("token_hashes", None)  # what an empty cache's blocks are named by is moot


@settings(max_examples=200, deadline=None)
@given(st.lists(events, max_size=40))
def test_applied_updates_equal_a_fresh_full_picture(script: list[tuple[Any, ...]]) -> None:
    book = LoadBook()
    sub = book.subscribe("r")
    view: dict[str, Any] = {}
    apply(view, book.full(sub, 0.0))
    for now, event in enumerate(script, start=1):
        if event[0] == "report":
            _, shard, waiting, gen = event
            book.report(
                "n",
                v1.LoadReport(
                    engines=[
                        v1.EngineLoad(shard_id=shard, known=True, waiting=waiting, generation=gen)
                    ]
                ),
                float(now),
            )
        elif event[0] == "cache":
            _, shard, stored, removed, cleared, token_hashes = event
            book.cache_events(
                "n",
                v1.CacheEvents(
                    shard_id=shard,
                    stored=sorted(stored),
                    removed=sorted(removed),
                    cleared=cleared,
                    token_hashes=token_hashes,
                ),
                float(now),
            )
        elif event[0] == "publish":
            # One endpoint per shard, as one leader shard leads one replica.
            mapping: dict[str, tuple[str, int]] = {}
            for eid, shard in sorted(event[1].items()):
                if shard not in {s for s, _ in mapping.values()}:
                    mapping[eid] = (shard, 100 + SHARDS.index(shard))
            book.set_endpoints(mapping, float(now))
        else:
            update = book.take(sub, float(now))
            if update is not None:
                apply(view, update)
    final = book.take(sub, 99.0)
    if final is not None:
        apply(view, final)
    fresh: dict[str, Any] = {}
    apply(fresh, book.full(book.subscribe("other"), 99.0))
    assert view == fresh


def test_an_engines_prefill_rate_goes_to_the_routers_and_status() -> None:
    # Issue 26.1: the rate the agent learned from the engine's metrics is relayed as is.
    book = LoadBook()
    book.set_endpoints({"e0": ("s0", 100)}, 0.0)
    sub = book.subscribe("r")
    engine = v1.EngineLoad(shard_id="s0", known=True, prefill_tokens_per_second=1234.5)
    book.report("n", v1.LoadReport(engines=[engine]), 1.0)
    update = book.take(sub, 1.0)
    assert update is not None
    assert [load.prefill_tokens_per_second for load in update.loads] == [1234.5]
    assert book.full(sub, 1.0).loads[0].prefill_tokens_per_second == 1234.5
    assert book.as_json(1.0)["e0"]["prefill_tokens_per_second"] == 1234.5
