"""A scripted control plane for router tests: `EndpointService` on real gRPC.

:class:`FakeControl` runs it as its own process (``python -m llmgw_testkit.fake_control``)
and drives it through files: :meth:`FakeControl.publish` writes the endpoint snapshot
it serves on Watch, :meth:`FakeControl.set_loads` the load figures it streams on
WatchLoad; its output shows each subscription and each demand report. It needs
llmgw-proto and grpclib, imported only in the process it runs.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from llmgw_testkit import Proc

__all__ = ["FakeControl", "HasUrl", "main"]


class HasUrl(Protocol):
    """An engine (simulator or other) that :meth:`FakeControl.publish` can list."""

    @property
    def id(self) -> str: ...

    @property
    def url(self) -> str: ...


@dataclass
class FakeControl:
    """The scripted control plane: write a snapshot, and it is published."""

    port: int
    snapshot_path: Path
    tmp_path: Path
    proc: Proc | None = None
    tls: tuple[Path, Path, Path] | None = None
    # A standby: every call is refused with this leader address.
    leader: str | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def loads_path(self) -> Path:
        return self.snapshot_path.with_name(self.snapshot_path.stem + "-loads.json")

    @property
    def keys_path(self) -> Path:
        return self.snapshot_path.with_name(self.snapshot_path.stem + "-keys.json")

    @property
    def shares_path(self) -> Path:
        return self.snapshot_path.with_name(self.snapshot_path.stem + "-shares.json")

    def start(self) -> None:
        argv = [sys.executable, "-m", "llmgw_testkit.fake_control", "--port", str(self.port)]
        argv += ["--loads", str(self.loads_path)]
        argv += ["--keys", str(self.keys_path), "--shares", str(self.shares_path)]
        if self.tls:
            argv += ["--tls", *map(str, self.tls)]
        if self.leader:
            argv += ["--leader", self.leader]
        self.proc = Proc(
            [*argv, "--snapshot", str(self.snapshot_path)], log_dir=self.tmp_path, name="control"
        )
        self.proc.wait_output(f"control on {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def publish(
        self,
        version: int,
        *ups: HasUrl,
        model: str = "m1",
        models: list[dict[str, Any]] | None = None,
        generations: dict[str, int] | None = None,
        leaving: set[str] | None = None,
    ) -> None:
        """``leaving``: the ids of the ``ups`` marked Endpoint.leaving (about to be taken away)."""
        endpoints = [
            {
                "id": f"{up.id}-replica",
                "url": up.url,
                "models": [model],
                "node_id": f"node-{up.id}",
                "generation": (generations or {}).get(up.id, 0),
                "leaving": up.id in (leaving or set()),
            }
            for up in ups
        ]
        body = {"version": version, "endpoints": endpoints, "models": models or []}
        tmp = self.snapshot_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body))
        tmp.replace(self.snapshot_path)

    def set_loads(self, loads: list[dict[str, Any]] | None) -> None:
        """Stream these EndpointLoad figures (None: stop sending any)."""
        if loads is None:
            self.loads_path.unlink(missing_ok=True)
            return
        tmp = self.loads_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(loads))
        tmp.replace(self.loads_path)

    def set_keys(self, version: int, keys: list[dict[str, Any]]) -> None:
        """Serve this key set on WatchKeys (items: ApiKey fields: name, prefix, sha256,
        rpm, tpm, max_concurrent, priority, weight, budget_tokens, revoked, ...)."""
        _write(self.keys_path, {"version": version, "keys": keys})

    def set_shares(self, shares: list[dict[str, Any]], valid_for: float = 3.0) -> None:
        """Answer every ReportUsage with these KeyShare fields (key, rpm, tpm, ...)."""
        _write(self.shares_path, {"valid_for": valid_for, "shares": shares})

    def output(self) -> str:
        return self.proc.output() if self.proc is not None else ""


def _write(path: Path, body: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> None:
    """A scripted control plane: serves `EndpointService` on real gRPC.

    It publishes the snapshot in ``--snapshot`` (JSON: version, endpoints, models) on
    subscribe and again whenever the file changes, streams the load figures in
    ``--loads`` (JSON: a list of EndpointLoad fields) as full updates every 100 ms while
    the file exists, prints each subscription and each demand report. WatchKeys streams
    the key set in ``--keys`` whenever it changes; ReportUsage prints each report (one
    line per key) and answers with the shares in ``--shares``. With ``--leader
    ADDR`` it is a standby: every call gets UNAVAILABLE with ``llmgw-leader: ADDR``.
    """
    import argparse

    import grpclib.const
    from grpclib.server import Server, Stream
    from llmgw_proto.v1 import (
        ApiKey,
        DeclaredModel,
        DemandReply,
        DemandRequest,
        Endpoint,
        EndpointLoad,
        EndpointServiceBase,
        EndpointSnapshot,
        KeySet,
        KeyShare,
        LoadUpdate,
        UsageReply,
        UsageReport,
        WatchRequest,
    )

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--snapshot", type=Path, required=True)
    parser.add_argument("--loads", type=Path)
    parser.add_argument("--keys", type=Path)
    parser.add_argument("--shares", type=Path)
    parser.add_argument("--leader")
    parser.add_argument("--tls", nargs=3, metavar=("CERT", "KEY", "CA"), type=Path)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    def read() -> tuple[str, EndpointSnapshot | None]:
        try:
            text = args.snapshot.read_text()
        except FileNotFoundError:
            return "", None
        data = json.loads(text)
        return text, EndpointSnapshot(
            version=data["version"],
            endpoints=[
                Endpoint(
                    id=ep["id"],
                    url=ep["url"],
                    served_model_names=ep["models"],
                    model=ep["models"][0],
                    profile=ep.get("profile", "default"),
                    weight=ep.get("weight", 1),
                    node_id=ep.get("node_id", ""),
                    replica_id=ep.get("replica_id", ""),
                    health_path="/health",
                    generation=ep.get("generation", 0),
                    leaving=ep.get("leaving", False),
                )
                for ep in data["endpoints"]
            ],
            models=[
                DeclaredModel(
                    name=m["name"],
                    served_model_names=m.get("served_model_names", [m["name"]]),
                    scale_to_zero=m.get("scale_to_zero", False),
                )
                for m in data.get("models", [])
            ],
        )

    def read_loads() -> LoadUpdate | None:
        if args.loads is None:
            return None
        try:
            items = json.loads(args.loads.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return LoadUpdate(
            full=True,
            loads=[
                EndpointLoad(
                    endpoint_id=item["endpoint_id"],
                    known=item.get("known", True),
                    running=item.get("running", 0),
                    waiting=item.get("waiting", 0),
                    kv_cache_usage=item.get("kv_cache_usage", 0.0),
                    generation=item.get("generation", 0),
                    age=datetime.timedelta(seconds=item.get("age", 0.0)),
                    prefill_tokens_per_second=item.get("prefill_tokens_per_second", 0.0),
                )
                for item in items
            ],
        )

    def read_json(path: Path | None) -> tuple[str, Any]:
        if path is None:
            return "", None
        try:
            text = path.read_text()
            return text, json.loads(text)
        except (FileNotFoundError, json.JSONDecodeError):
            return "", None

    class Scripted(EndpointServiceBase):
        async def watch_keys(self, message: WatchRequest) -> Any:
            print(f"keys subscribed router_id={message.router_id}", flush=True)
            sent = ""
            while True:
                text, data = read_json(args.keys)
                if data is not None and text != sent:
                    sent = text
                    print(f"keys published version={data['version']}", flush=True)
                    yield KeySet(version=data["version"], keys=[ApiKey(**k) for k in data["keys"]])
                await asyncio.sleep(0.05)

        async def report_usage(self, message: UsageReport) -> UsageReply:
            for u in message.usage:
                print(
                    f"usage router_id={message.router_id} instance={message.instance} "
                    f"sequence={message.sequence} key={u.key} requests={u.requests} "
                    f"prompt_tokens={u.prompt_tokens} completion_tokens={u.completion_tokens} "
                    f"errors={u.errors} refused={u.refused} demand_rpm={u.demand_rpm:.1f}",
                    flush=True,
                )
            _, data = read_json(args.shares)
            if data is None:
                return UsageReply()
            return UsageReply(
                shares=[KeyShare(**s) for s in data["shares"]],
                valid_for=datetime.timedelta(seconds=data["valid_for"]),
            )

        async def watch(self, message: WatchRequest) -> Any:
            print(
                f"subscribed router_id={message.router_id} known_version={message.known_version}",
                flush=True,
            )
            sent = ""
            while True:
                text, snapshot = read()
                if snapshot is not None and text != sent:
                    sent = text
                    print(f"published version={snapshot.version}", flush=True)
                    yield snapshot
                await asyncio.sleep(0.05)

        async def watch_load(self, message: WatchRequest) -> Any:
            print(f"load subscribed router_id={message.router_id}", flush=True)
            while True:
                update = read_loads()
                if update is not None:
                    yield update
                await asyncio.sleep(0.1)

        async def report_demand(self, message: DemandRequest) -> DemandReply:
            print(f"demand model={message.model} held={message.held}", flush=True)
            return DemandReply(accepted=True)

    class Standby:
        """Answers every call UNAVAILABLE and names the leader in trailing metadata."""

        def __mapping__(self) -> dict[str, grpclib.const.Handler]:
            async def refuse(stream: Stream[Any, Any]) -> None:
                await stream.recv_message()
                print("refused as standby", flush=True)
                await stream.send_trailing_metadata(
                    status=grpclib.const.Status.UNAVAILABLE,
                    status_message="standby",
                    metadata={"llmgw-leader": args.leader},
                )

            real = Scripted().__mapping__()
            return {
                route: grpclib.const.Handler(refuse, h.cardinality, h.request_type, h.reply_type)
                for route, h in real.items()
            }

    async def serve() -> None:
        from llmgw_proto.tls import server_context

        server = Server([Standby() if args.leader else Scripted()])
        ssl = server_context(*args.tls) if args.tls else None
        await server.start("127.0.0.1", args.port, ssl=ssl)
        print(f"control on {args.port}", flush=True)
        await server.wait_closed()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
