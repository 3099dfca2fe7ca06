"""HTTP/2 pings that find a control plane that stopped answering.

grpclib sends a keepalive ping every ``_keepalive_time`` and closes the connection
when one is not answered within ``_keepalive_timeout``, but by default it sends no
ping within 300 s of the last one (``_http2_min_sent_ping_interval_without_data``)
and at most two without data sent in between (``_http2_max_pings_without_data``).
A client that keeps writing (heartbeats) to a frozen peer (SIGSTOP, a hung host)
therefore pinged once and then not again for five minutes: nothing noticed that the
peer had stopped answering. :func:`keepalive` lifts both limits, so an unanswered
ping ends the connection within ``interval + timeout`` whatever else is sent; the
streams on it then fail and the client tries the next control plane.

The control plane's grpclib server answers pings without policing them.
"""

from __future__ import annotations

from typing import Any

from grpclib.config import Configuration

__all__ = ["MIN_SECONDS", "keepalive", "keepalive_problem"]

# The shortest interval or timeout taken: shorter is no keepalive but a busy loop (and half
# of a subnormal interval is 0, which grpclib refuses).
MIN_SECONDS = 0.01


def keepalive_problem(interval: float, timeout: float) -> tuple[str, str] | None:
    """(field, what is wrong) for settings grpclib would refuse, or None."""
    if not interval >= MIN_SECONDS:
        return "keepalive", "must be >= 10ms (e.g. `10s`)"
    if not timeout >= MIN_SECONDS:
        return "keepalive_timeout", "must be >= 10ms (e.g. `20s`)"
    return None


def keepalive(interval: float, timeout: float, **extra: Any) -> Configuration:
    """A channel configuration pinging every ``interval`` seconds, giving the
    connection up when a ping is not answered within ``timeout``."""
    return Configuration(
        _keepalive_time=interval,
        _keepalive_timeout=timeout,
        _keepalive_permit_without_calls=True,
        _http2_max_pings_without_data=0,  # no limit
        # Below the interval: the ping timer fires at (about) every interval.
        _http2_min_sent_ping_interval_without_data=interval / 2,
        **extra,
    )
