"""Who may change the fleet: the admin token and admin certificates, on real sockets."""

from __future__ import annotations

import asyncio
import json
import ssl
import stat
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from llmgw_control.admin import CHANGED_BY, AdminServer, Answer, json_answer
from llmgw_control.auth import Credentials, TokenError, load_token
from llmgw_control.ca import init_ca, issue
from llmgw_control.metrics import Metrics
from llmgw_proto.tls import server_context

TOKEN = "t" * 32


class Source:
    def status(self) -> dict[str, Any]:
        return {"ok": True}

    def summary(self) -> dict[str, Any]:
        return {}

    def explain(self, model: str) -> dict[str, Any] | None:
        return None


async def serve(tls: ssl.SSLContext | None) -> tuple[AdminServer, int, list[str]]:
    admin = AdminServer(Source(), Metrics().registry)
    admin.credentials = Credentials(token=TOKEN, certificates=tls is not None)
    seen: list[str] = []

    async def handler(method: str, target: str, body: bytes) -> Answer | None:
        if method != "POST":
            return None
        seen.append(CHANGED_BY.get())
        return json_answer(200, {"by": CHANGED_BY.get()})

    admin.handlers.append(handler)
    await admin.start("127.0.0.1", 0, tls=tls)
    assert admin._server is not None
    port = int(admin._server.sockets[0].getsockname()[1])
    return admin, port, seen


def call(
    url: str, *, method: str = "POST", token: str = "", context: Any = None
) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=b"{}" if method == "POST" else None, method=method)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as resp:
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return int(err.code), json.loads(err.read())


async def test_changes_need_the_token_gets_do_not() -> None:
    admin, port, seen = await serve(None)
    base = f"http://127.0.0.1:{port}"
    try:
        code, data = await asyncio.to_thread(call, base + "/v1/x")
        assert code == 401
        assert "Bearer" in data["error"]
        code, data = await asyncio.to_thread(call, base + "/v1/x", token="wrong")
        assert (code, data["error"]) == (401, "wrong admin token")
        code, data = await asyncio.to_thread(call, base + "/v1/x", token=TOKEN)
        assert (code, data) == (200, {"by": "token"})
        code, data = await asyncio.to_thread(call, base + "/v1/status", method="GET")
        assert (code, data) == (200, {"ok": True})
        assert seen == ["token"]
    finally:
        await admin.close()


async def test_an_admin_certificate_may_change_a_node_certificate_may_not(tmp_path: Path) -> None:
    ca = tmp_path / "ca"
    init_ca(ca)
    srv = issue(ca, "server", "localhost", hosts=["localhost", "127.0.0.1"])
    tls = server_context(srv.cert, srv.key, ca / "ca.crt", require_client_cert=False)
    tls.set_alpn_protocols(["http/1.1"])
    admin, port, seen = await serve(tls)
    base = f"https://127.0.0.1:{port}"

    def client(role: str | None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(ca / "ca.crt"))
        if role is not None:
            made = issue(ca, role, "alice" if role == "admin" else "gpu-a")
            ctx.load_cert_chain(made.cert, made.key)
        return ctx

    try:
        code, data = await asyncio.to_thread(call, base + "/v1/x", context=client("admin"))
        assert (code, data) == (200, {"by": "admin:alice"})
        code, data = await asyncio.to_thread(call, base + "/v1/x", context=client("node"))
        assert code == 403
        assert "node 'gpu-a' is not an admin's" in data["error"]
        code, data = await asyncio.to_thread(call, base + "/v1/x", context=client(None))
        assert code == 401
        assert "admin client certificate" in data["error"]
        # Without a certificate, the token still works; the status page needs none.
        code, data = await asyncio.to_thread(
            call, base + "/v1/x", token=TOKEN, context=client(None)
        )
        assert (code, data) == (200, {"by": "token"})
        code, _ = await asyncio.to_thread(
            call, base + "/v1/status", method="GET", context=client(None)
        )
        assert code == 200
        assert seen == ["admin:alice", "token"]
    finally:
        await admin.close()


def test_token_file_made_owner_only_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "state" / "admin.token"
    token = load_token(path, create=True)
    assert len(token) == 64
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_token(path, create=False) == token
    path.chmod(0o644)
    with pytest.raises(TokenError, match=r"readable by group or others .*chmod 600"):
        load_token(path, create=False)
    path.chmod(0o600)
    path.write_text("short\n")
    with pytest.raises(TokenError, match="16 or more"):
        load_token(path, create=False)
    with pytest.raises(TokenError, match="no such file"):
        load_token(tmp_path / "none", create=False)


def test_ca_issue_admin(tmp_path: Path) -> None:
    from click.testing import CliRunner
    from llmgw_control.cli import main
    from llmgw_proto.tls import read_identity

    ca = str(tmp_path / "ca")
    runner = CliRunner()
    assert runner.invoke(main, ["ca", "init", "--dir", ca]).exit_code == 0
    done = runner.invoke(main, ["ca", "issue", "--dir", ca, "--admin", "alice"])
    assert done.exit_code == 0, done.output
    assert "admin certificate" in done.output
    cert = ssl._ssl._test_decode_cert(str(tmp_path / "ca" / "admin-alice.crt"))  # type: ignore[attr-defined]
    assert read_identity(cert).role == "admin"
    both = runner.invoke(main, ["ca", "issue", "--dir", ca, "--admin", "a", "--node", "b"])
    assert both.exit_code != 0
    assert "exactly one of --node NAME, --router NAME, --admin NAME" in both.output
