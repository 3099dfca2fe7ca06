"""Runs :class:`llmgw_sim.scheduler.Scheduler` against the clock, one step at a time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from llmgw_sim.scheduler import Scheduler, Seq, StepCosts, StepPlan


class Waiter:
    """What one request's handler waits on: tokens sampled so far and whether it is done."""

    __slots__ = ("admitted_at", "done", "event", "first_at", "stream", "tokens")

    def __init__(self, *, stream: bool = True) -> None:
        # A non-streaming handler is woken only for its first token and its end.
        self.stream = stream
        self.tokens = 0
        self.done = False
        self.admitted_at: float | None = None
        self.first_at: float | None = None
        self.event = asyncio.Event()


class StepDriver:
    """The engine's busy loop: plan a step, take its time, deliver what it sampled.

    Step boundaries follow the model's clock (each step ends ``step_time`` after the
    previous one ended, or after now when the engine was idle or the host ran late), so
    a busy host adds latency without inflating the engine's throughput.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        costs: StepCosts,
        *,
        on_step: Callable[[StepPlan], None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.costs = costs
        self._waiters: dict[int, Waiter] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._on_step = on_step
        self.steps = 0

    def submit(self, seq: Seq, *, stream: bool = True) -> Waiter:
        waiter = Waiter(stream=stream)
        self._waiters[seq.rid] = waiter
        self.scheduler.add(seq)
        self._wake.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        return waiter

    def abort(self, rid: int) -> None:
        """The client went away (or the request ended): free its place and blocks."""
        if self._waiters.pop(rid, None) is not None:
            self.scheduler.abort(rid)
            self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        sched = self.scheduler
        prev_end = loop.time()
        while True:
            if sched.idle:
                self._wake.clear()
                await self._wake.wait()
                prev_end = loop.time()
            plan = sched.schedule()
            if plan.empty:
                # Queued work that cannot run yet (only after an abort frees room).
                self._wake.clear()
                await self._wake.wait()
                continue
            self.steps += 1
            now = time.monotonic()
            for item in plan.items:
                w = self._waiters.get(item.seq.rid)
                if w is not None and w.admitted_at is None:
                    w.admitted_at = now
            end = max(prev_end, loop.time()) + self.costs.step_time(
                plan.prefill_tokens, plan.decodes
            )
            delay = end - loop.time()
            # sleep(0) still yields, so handlers write between back-to-back steps.
            await asyncio.sleep(max(0.0, delay))
            prev_end = end
            now = time.monotonic()
            for ev in sched.finish_step(plan):
                w = self._waiters.get(ev.rid)
                if w is None:
                    continue
                if ev.new_tokens:
                    w.tokens += ev.new_tokens
                    if w.first_at is None:
                        w.first_at = now
                if ev.finished:
                    w.done = True
                    del self._waiters[ev.rid]
                if w.stream or ev.finished or ev.first:
                    w.event.set()
            if self._on_step is not None:
                self._on_step(plan)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
