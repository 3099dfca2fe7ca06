"""Keys and usage against a real `llmgw-control serve` process (SQLite store): the CLI as
an operator runs it, WatchKeys and ReportUsage as a router calls them, and a restart."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpclib.client
from llmgw_proto import v1
from llmgw_testkit import wait_for_async

Factory = Callable[..., Any]
SECRET = re.compile(r"llmgw_[0-9a-f]{8}_[A-Za-z0-9_-]{32,}")


def cli(control: Any, *args: str, token: bool = True) -> subprocess.CompletedProcess[str]:
    """One `llmgw-control` command, as an operator runs it."""
    extra = ["--admin", control.admin]
    if token and args[0] == "keys":
        extra += ["--token-file", str(control.tmp_path / "control-state" / "admin.token")]
    return subprocess.run(
        [sys.executable, "-m", "llmgw_control", *args, *extra],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


class KeyWatcher:
    """A router's end of EndpointService.WatchKeys, keeping every key set it receives."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sets: list[v1.KeySet] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> KeyWatcher:
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        channel = grpclib.client.Channel("127.0.0.1", self.port)
        try:
            stub = v1.EndpointServiceStub(channel)
            async for key_set in stub.watch_keys(v1.WatchRequest(router_id="r1")):
                self.sets.append(key_set)
        finally:
            channel.close()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task

    async def until(self, check: Callable[[dict[str, v1.ApiKey]], bool], what: str) -> None:
        async def probe() -> bool | None:
            if not self.sets:
                return None
            return check({k.name: k for k in self.sets[-1].keys}) or None

        await wait_for_async(probe, timeout=30.0, interval=0.05, what=what)


async def report(
    port: int, seq: int, usage: dict[str, dict[str, Any]], instance: str = "r1-a"
) -> v1.UsageReply:
    channel = grpclib.client.Channel("127.0.0.1", port)
    try:
        stub = v1.EndpointServiceStub(channel)
        return await stub.report_usage(
            v1.UsageReport(
                router_id="r1",
                instance=instance,
                sequence=seq,
                usage=[v1.KeyUsage(key=k, **fields) for k, fields in usage.items()],
            ),
            timeout=20,
        )
    finally:
        channel.close()


def share(reply: v1.UsageReply, key: str) -> v1.KeyShare:
    return next(s for s in reply.shares if s.key == key)


async def test_keys_from_the_cli_to_a_router_and_usage_through_a_restart(
    control_factory: Factory,
) -> None:
    control = control_factory([])
    watcher = KeyWatcher(control.grpc_port).start()
    try:
        await watcher.until(lambda keys: keys == {}, "the empty key set")

        made = await asyncio.to_thread(
            cli, control, "keys", "create", "team-a", "--rpm", "60", "--models", "m1,m2",
            "--budget-tokens", "1000", "--budget-period", "day",
        )  # fmt: skip
        assert made.returncode == 0, made.stderr
        lines = made.stdout.strip().splitlines()
        secret = lines[-1]
        assert SECRET.fullmatch(secret), made.stdout
        assert secret not in made.stdout.rsplit(secret, 1)[0]  # printed once, last

        await watcher.until(lambda keys: "team-a" in keys, "the new key at the router")
        key = {k.name: k for k in watcher.sets[-1].keys}["team-a"]
        assert key.prefix == secret[:14]
        assert key.sha256 == hashlib.sha256(secret.encode()).hexdigest()
        assert (key.rpm, list(key.models), key.budget_tokens) == (60, ["m1", "m2"], 1000)
        assert all(secret not in str(s) for s in watcher.sets)

        changed = await asyncio.to_thread(cli, control, "keys", "update", "team-a", "--rpm", "90")
        assert changed.returncode == 0, changed.stderr
        await watcher.until(lambda keys: keys["team-a"].rpm == 90, "the change at the router")

        # Usage: counted once per (instance, sequence), whatever is retried.
        u = {"requests": 3, "prompt_tokens": 100, "completion_tokens": 50, "demand_rpm": 6.0}
        first = await report(control.grpc_port, 1, {"team-a": u})
        assert share(first, "team-a").budget_used == 150
        assert 0 < share(first, "team-a").rpm <= 90
        assert 0 < share(first, "team-a").budget_tokens <= 850
        assert first.valid_for == dt.timedelta(seconds=10)
        again = await report(control.grpc_port, 1, {"team-a": u})
        assert share(again, "team-a").budget_used == 150
        await report(control.grpc_port, 2, {"team-a": u})

        used = await asyncio.to_thread(cli, control, "usage", "--key", "team-a", "--since", "1h")
        assert used.returncode == 0, used.stderr
        row = used.stdout.strip().splitlines()[-1].split()
        assert row[:4] == ["team-a", "6", "200", "100"], used.stdout
        listed = await asyncio.to_thread(cli, control, "keys", "list")
        assert "team-a" in listed.stdout
        assert "300 of 1000" in listed.stdout, listed.stdout
        code, status = await control.get("/v1/status")
        assert code == 200
        assert status["keys"]["keys"][0]["budget_used"] == 300
        _, metrics = await control.get("/metrics")
        assert 'llmgw_control_key_requests_total{key="team-a"} 6.0' in metrics

        # A restart reads the usage back; a report retried across it is not counted again.
        await watcher.stop()
        control.stop()
        control.start()
        watcher = KeyWatcher(control.grpc_port).start()
        await watcher.until(lambda keys: "team-a" in keys, "the key after a restart")
        retried = await report(control.grpc_port, 2, {"team-a": u})
        assert share(retried, "team-a").budget_used == 300
        after = await report(control.grpc_port, 3, {"team-a": u})
        assert share(after, "team-a").budget_used == 450

        revoked = await asyncio.to_thread(cli, control, "keys", "revoke", "team-a")
        assert revoked.returncode == 0, revoked.stderr
        await watcher.until(lambda keys: keys["team-a"].revoked, "the revocation at the router")
        gone = await report(control.grpc_port, 4, {"team-a": u})
        assert gone.shares == []
    finally:
        await watcher.stop()


async def test_bad_input_and_missing_credentials_are_named(
    control_factory: Factory, tmp_path: Path
) -> None:
    control = control_factory([])
    bad = await asyncio.to_thread(cli, control, "keys", "create", "k", "--rpm", "abc")
    assert bad.returncode == 2
    assert "error: --rpm: expected a whole number from 0 to 4294967295, got 'abc'" in bad.stderr
    assert "Traceback" not in bad.stderr
    period = await asyncio.to_thread(cli, control, "keys", "create", "k", "--budget-tokens", "5")
    assert period.returncode == 2
    assert "--budget-tokens: needs --budget-period day or month" in period.stderr
    name = await asyncio.to_thread(cli, control, "keys", "create", "a/b")
    assert name.returncode == 2
    assert "NAME: 'a/b' is not a key name" in name.stderr
    since = await asyncio.to_thread(cli, control, "usage", "--since", "soon")
    assert since.returncode == 2
    assert "--since: expected a duration" in since.stderr
    unknown = await asyncio.to_thread(cli, control, "keys", "revoke", "nobody")
    assert unknown.returncode == 1
    assert "no key named 'nobody'" in unknown.stderr
    anonymous = await asyncio.to_thread(cli, control, "keys", "create", "k", token=False)
    assert anonymous.returncode == 1
    assert "Traceback" not in anonymous.stderr
    assert "token" in anonymous.stderr.lower()
    twice = [await asyncio.to_thread(cli, control, "keys", "create", "k") for _ in range(2)]
    assert twice[0].returncode == 0
    assert twice[1].returncode == 1
    assert "a key named 'k' exists" in twice[1].stderr
    # The admin API itself: a body that is no JSON object.
    code, body = await asyncio.to_thread(_post, control, "/v1/keys", b"[1]")
    assert code == 400
    assert b"must be a JSON object" in body


def _post(control: Any, path: str, body: bytes) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    token = (control.tmp_path / "control-state" / "admin.token").read_text().strip()
    request = urllib.request.Request(control.admin + path, data=body)
    request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as err:
        return int(err.code), bytes(err.read())
