"""The web status page on the admin listener: one static HTML file over /v1/status.

The page (``static/status.html``, shipped in the wheel) holds its own CSS and
JavaScript and polls the JSON status API with ``fetch``; the control plane only
hands the file out, so the page adds no state and no work to the control loop.
"""

from __future__ import annotations

import functools
from importlib import resources

__all__ = ["PATHS", "page"]

PATHS = frozenset({"/", "/index.html", "/status.html"})

_HTML = "text/html; charset=utf-8"


@functools.cache
def _body() -> bytes:
    return resources.files("llmgw_control").joinpath("static/status.html").read_bytes()


def page() -> tuple[int, str, bytes]:
    """Status, content type and body of the status page."""
    return 200, _HTML, _body()
