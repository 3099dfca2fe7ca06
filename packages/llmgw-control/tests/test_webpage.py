"""The web status page: served at / by the admin responder, shipped in the wheel."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
from llmgw_control import webpage
from llmgw_control.admin import AdminServer
from llmgw_control.metrics import Metrics

PACKAGE = Path(__file__).resolve().parent.parent


class Source:
    def status(self) -> dict[str, Any]:
        return {"nodes": [], "replicas": []}

    def summary(self) -> dict[str, Any]:
        return {}

    def explain(self, model: str) -> dict[str, Any] | None:
        return None


def admin() -> AdminServer:
    return AdminServer(Source(), Metrics().registry)


@pytest.mark.parametrize("path", ["/", "/index.html", "/?refresh=5"])
def test_root_serves_the_status_page(path: str) -> None:
    code, ctype, body = admin().route("GET", path)
    assert code == 200
    assert ctype == "text/html; charset=utf-8"
    assert body.startswith(b"<!doctype html>")
    # The page reads the JSON API relative to itself, so a proxy prefix keeps working.
    assert b'"v1/status"' in body


def test_page_never_writes_status_values_as_html() -> None:
    text = webpage.page()[2].decode()
    script = text.split("<script>", 1)[1]
    assert not re.search(r"\.(innerHTML|outerHTML)\b|insertAdjacentHTML|document\.write", script)


def test_other_paths_still_answer_json() -> None:
    code, ctype, _ = admin().route("GET", "/v1/status")
    assert (code, ctype) == (200, "application/json")
    code, _, body = admin().route("GET", "/nope")
    assert code == 404
    assert b"try /, /v1/status" in body


def test_the_wheel_ships_the_page(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "uv", "build", "--wheel", "--out-dir", str(tmp_path), str(PACKAGE)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("llmgw_control-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert "llmgw_control/static/status.html" in z.namelist()
        assert z.read("llmgw_control/static/status.html") == webpage.page()[2]
