"""Asking an engine over HTTP: is it ready, how many requests does it run."""

from __future__ import annotations

from llmgw_agent.load import metric_values
from llmgw_agent.probe import http_get

__all__ = ["health_status", "running_requests"]


async def health_status(url: str, *, timeout: float, api_key: str = "") -> int:
    """The health endpoint's HTTP status; 0 when nothing answered."""
    try:
        status, _ = await http_get(url, timeout=timeout, api_key=api_key)
    except (OSError, TimeoutError):
        return 0
    return status


async def running_requests(metrics_url: str, metric: str, api_key: str = "") -> float | None:
    """The engine's own count of running requests; None when it cannot be read."""
    try:
        status, body = await http_get(metrics_url, timeout=5.0, api_key=api_key)
    except (OSError, TimeoutError):
        return None
    if status != 200:
        return None
    return metric_values(body.decode(errors="replace"), [metric]).get(metric)
