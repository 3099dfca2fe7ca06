"""A drain that keeps the cache warm (issue 28 point 3): the timing (leaving.py, pure); the
reconciler's part is in test_reconciler.py (test_scale_down_publishes_leaving_...)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from llmgw_control.leaving import leave_times, publishes_leaving

times = st.floats(0, 1e6, allow_nan=False)
spans = st.floats(-10, 1e4, allow_nan=False)


@given(times, spans, spans, st.booleans(), times)
def test_leave_times_are_bounded(
    now: float, warm: float, timeout: float, serving: bool, later: float
) -> None:
    leave_at, deadline = leave_times(now, warm, timeout, serving)
    # The drain starts no earlier than now, and at most the warning later.
    assert now <= leave_at <= now + max(0.0, warm)
    if not serving or warm <= 0:
        assert leave_at == now
    # The whole drain_timeout is still ahead when the drain starts.
    assert deadline >= leave_at
    assert abs((deadline - leave_at) - max(0.0, timeout)) <= 1e-6 * max(1.0, deadline)
    # Published leaving exactly until the drain starts; never when not retired.
    assert publishes_leaving(True, leave_at, now + later) == (now + later < leave_at)
    assert not publishes_leaving(False, leave_at, now)
