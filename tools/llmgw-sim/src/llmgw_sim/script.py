"""Scripted behaviour for tests (``--sim-script-routes``): failures and health set at run time
through ``POST /sim/script``, and request counts read from ``GET /sim/stats``.

:class:`Script` is pure state: what the next inference request must do, and the counts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

HANG = 0  # a scripted status of 0: the request hangs until its client leaves


class ScriptError(ValueError):
    """A ``/sim/script`` body is wrong; the message names the field."""


@dataclass
class Script:
    """What ``/sim/script`` set, and what ``/sim/stats`` reports."""

    status: int = 500
    count: int = 0
    healthy: bool = True
    itl: float | None = None  # None: --sim-itl's
    counts: dict[str, int] = field(
        default_factory=lambda: {"started": 0, "completed": 0, "cancelled": 0, "in_flight": 0}
    )

    def update(self, body: Any) -> None:
        """Apply a ``/sim/script`` body (any of status, count, healthy, itl), all or nothing."""
        if not isinstance(body, dict):
            raise ScriptError("/sim/script: the body must be a JSON object")
        unknown = sorted(set(body) - {"status", "count", "healthy", "itl"})
        if unknown:
            raise ScriptError(f"/sim/script: unknown field {unknown[0]!r}")
        status, count, healthy = (
            body.get("status", self.status),
            body.get("count", self.count),
            body.get("healthy", self.healthy),
        )
        itl = body.get("itl", self.itl)
        if isinstance(status, bool) or not isinstance(status, int):
            raise ScriptError(f"/sim/script: status must be an integer, got {status!r}")
        if status != HANG and not 400 <= status <= 599:
            raise ScriptError(f"/sim/script: status must be 0 (hang) or 400-599, got {status}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ScriptError(f"/sim/script: count must be an integer >= 0, got {count!r}")
        if not isinstance(healthy, bool):
            raise ScriptError(f"/sim/script: healthy must be true or false, got {healthy!r}")
        if itl is not None and (
            isinstance(itl, bool) or not isinstance(itl, int | float) or not 0 <= itl < 3600
        ):
            raise ScriptError(f"/sim/script: itl must be null or seconds in [0, 3600), got {itl!r}")
        self.status, self.count, self.healthy = status, count, healthy
        self.itl = None if itl is None else float(itl)

    def state(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "count": self.count,
            "healthy": self.healthy,
            "itl": self.itl,
        }

    def next_failure(self) -> int | None:
        """The status the next inference request must answer (0: hang), or None: serve it."""
        if self.count <= 0:
            return None
        self.count -= 1
        return self.status
