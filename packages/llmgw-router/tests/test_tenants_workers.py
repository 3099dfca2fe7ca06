"""The fair-share queue's cap and headroom are a router's, as a router-config key's limits
are: with `workers: N` each worker takes ceil(cap / N) (at least 1 when the cap is set),
so N workers let about the cap through, not N times it."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from llmgw_proto.config import Duration
from llmgw_router.config import RouterConfig
from llmgw_router.endpoints import Endpoint, EndpointSet, EndpointSpec
from llmgw_router.metrics import Metrics
from llmgw_router.state import RouterState
from llmgw_router.tenants.config import QueueConfig, TenantsConfig
from llmgw_router.tenants.gate import Tenancy, _part


def _tenancy(workers: int, **queue: Any) -> Tenancy:
    tenants = TenantsConfig(queue=QueueConfig(max_wait=Duration(30.0), **queue))
    config = RouterConfig(tenants=tenants)
    state = RouterState(config, EndpointSet((), source="static"), Metrics())
    return Tenancy(state, config.tenants, workers)


@given(count=st.integers(min_value=0, max_value=100_000), workers=st.integers(1, 256))
def test_a_workers_part_adds_up_to_the_routers(count: int, workers: int) -> None:
    part = _part(count, workers)
    # All workers together: the router's count, and less than one more each.
    assert count <= part * workers < count + workers
    assert (part >= 1) == (count >= 1)
    if workers == 1:
        assert part == count


def test_each_worker_takes_its_part_of_the_cap_and_the_headroom() -> None:
    # per_endpoint 8: headroom unset is 2 (a quarter).
    assert (_tenancy(1, per_endpoint=8).cap, _tenancy(1, per_endpoint=8).headroom) == (8, 2)
    assert (_tenancy(4, per_endpoint=8).cap, _tenancy(4, per_endpoint=8).headroom) == (2, 1)
    assert (_tenancy(3, per_endpoint=8).cap, _tenancy(3, per_endpoint=8).headroom) == (3, 1)
    # More workers than the cap: one each, never 0 (which would mean no cap).
    assert _tenancy(16, per_endpoint=8).cap == 1
    assert _tenancy(4, per_endpoint=8, headroom=0).headroom == 0
    assert _tenancy(4, per_endpoint=8, headroom=6).headroom == 2
    # No cap: none in any worker; the queue stays off.
    tenancy = _tenancy(4)
    assert (tenancy.cap, tenancy.headroom, tenancy.queue_on) == (0, 0, False)


async def _admitted_before_held(tenancy: Tenancy) -> int:
    """Requests of one key a worker lets through to one endpoint before it holds one."""
    ep = Endpoint(spec=EndpointSpec(id="e", url="http://127.0.0.1:1", models=("m",)))
    tickets = []
    while True:
        task = asyncio.create_task(tenancy.admit(None, "m", (ep,), b"{}"))
        for _ in range(5):
            await asyncio.sleep(0)
        if not task.done():
            break
        tickets.append(task.result())
        assert len(tickets) <= 100, "never held"
    gate = tenancy.gates["m"]
    assert (gate.in_flight, len(gate.queue)) == (len(tickets), 1)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert len(gate.queue) == 0
    for ticket in tickets:
        tenancy.done(ticket, 1, 1, 200)
    await tenancy.close()
    return len(tickets)


async def test_a_worker_holds_requests_past_its_part_of_the_cap() -> None:
    assert await _admitted_before_held(_tenancy(1, per_endpoint=6, headroom=0)) == 6
    assert await _admitted_before_held(_tenancy(2, per_endpoint=6, headroom=0)) == 3
    assert await _admitted_before_held(_tenancy(4, per_endpoint=6, headroom=0)) == 2
    assert await _admitted_before_held(_tenancy(8, per_endpoint=6, headroom=0)) == 1
