"""The local demo: a whole llmgw system on this machine, engines simulated.

    nox -s demo              # run until Ctrl-C
    nox -s demo -- --once    # show everything once, then stop by itself

It starts the control plane, the router and two agents (8 and 4 simulated GPUs)
from examples/local/, over mutual TLS with certificates it makes on first run,
waits for the placeable replicas, streams a chat completion through the router
with the official openai client, and prints `llmgw-control status` and
`llmgw-control explain` for the model that cannot fit anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
from llmgw_testkit import Proc, port_open, wait_for
from llmgw_testkit.cluster import SystemView, bin_path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = Path("examples/local")
CERTS = EXAMPLES / "certs"
DEMO = Path(".demo")
PORTS = {7070: "control plane (gRPC)", 9091: "control admin", 8080: "router", 9090: "router admin"}
ADMIN = "http://127.0.0.1:9091"


def say(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed:\n{done.stderr}")
    return done.stdout


def make_certs() -> None:
    if (CERTS / "ca.crt").exists():
        return
    say(f"making a CA and certificates in {CERTS}/ (first run only)")
    control = bin_path("llmgw-control")
    run(control, "ca", "init", "--dir", str(CERTS))
    run(control, "ca", "issue", "--dir", str(CERTS), "--server", "localhost,127.0.0.1")
    for node in ("gpu-a", "gpu-b"):
        run(control, "ca", "issue", "--dir", str(CERTS), "--node", node)
    run(control, "ca", "issue", "--dir", str(CERTS), "--router", "local-router")


def check_ports() -> None:
    busy = [f"{port} ({what})" for port, what in PORTS.items() if port_open(port)]
    if busy:
        sys.exit(f"these ports are taken, stop whatever uses them first: {', '.join(busy)}")


def replicas(status: dict[str, object], model: str, state: str) -> int:
    rows = status["replicas"]
    assert isinstance(rows, list)
    return sum(1 for r in rows if r["model"] == model and r["state"] == state)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--once", action="store_true", help="stop by itself after the tour")
    args = parser.parse_args()
    os.chdir(ROOT)
    # The agents find `llmgw-sim` (the engines' stand-in) on PATH: this environment's.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    check_ports()
    make_certs()
    logs = DEMO / "logs"
    procs: list[Proc] = []

    def start(name: str, *argv: str) -> Proc:
        proc = Proc([bin_path(argv[0]), *argv[1:]], log_dir=logs, name=name, grace=20)
        procs.append(proc)
        return proc

    stopping = threading.Event()
    failed = False
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    try:
        say(f"starting the control plane, two agents and the router (logs in {logs}/)")
        control = start(
            "control", "llmgw-control", "serve", "--config", str(EXAMPLES / "control.yaml")
        )
        wait_for(
            lambda: port_open(9091) or (control.tail() and not control.alive()),
            timeout=30,
            what="control plane",
        )
        if not control.alive():
            sys.exit(f"the control plane did not start:\n{control.tail()}")
        for node in ("a", "b"):
            start(
                f"agent-gpu-{node}",
                "llmgw-agent",
                "run",
                "--config",
                str(EXAMPLES / f"agent-{node}.yaml"),
            )
        start("router", "llmgw-router", "serve", "--config", str(EXAMPLES / "router.yaml"))

        say("waiting for tiny-chat (2 replicas) and big-chat (1 replica over 2 nodes) to be ready")
        cluster = SystemView(admin_port=9091, router_port=8080, router_admin_port=9090)

        def ready() -> bool:
            for proc in procs:
                if not proc.alive():
                    raise SystemExit(f"{proc.name} exited:\n{proc.tail()}")
            status = cluster.status()
            return (
                replicas(status, "tiny-chat", "ready") == 2
                and replicas(status, "big-chat", "ready") == 1
            )

        wait_for(ready, timeout=120, what="the replicas")
        wait_for(
            lambda: {"tiny-chat", "big-chat"} <= cluster.router_models(), timeout=60, what="router"
        )

        say("a streaming chat completion through the router (official openai client)")
        client = openai.OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="demo")
        print("$ tiny-chat> Tell me about GPUs.", flush=True)
        stream = client.chat.completions.create(
            model="tiny-chat",
            messages=[{"role": "user", "content": "Tell me about GPUs."}],
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
            if chunk.usage:
                print(
                    f"\n[usage: {chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens]"
                )

        say("llmgw-control status")
        print(run(bin_path("llmgw-control"), "status", "--admin", ADMIN))
        say("llmgw-control explain huge-chat")
        print(run(bin_path("llmgw-control"), "explain", "huge-chat", "--admin", ADMIN))

        if not args.once:
            say(
                "running: the OpenAI API is at http://127.0.0.1:8080/v1 (models tiny-chat, big-chat).\n"
                "    try: curl -s http://127.0.0.1:8080/v1/chat/completions -H 'content-type: application/json' \\\n"
                '           -d \'{"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]}\'\n'
                "    Ctrl-C stops everything."
            )
            try:
                while not stopping.is_set():
                    time.sleep(0.5)
            except KeyboardInterrupt:
                pass
    except KeyboardInterrupt:
        pass
    except TimeoutError as err:
        print(f"\nthe demo did not come up: {err}", file=sys.stderr)
        for proc in procs:
            print(
                f"----- {proc.name} (last lines of {proc.log_path})\n{proc.tail(15)}",
                file=sys.stderr,
            )
        failed = True
    finally:
        say("stopping the router, the agents (and their engines) and the control plane")
        for proc in reversed(procs):
            proc.stop()
        # Engines an agent could not stop (it was killed, say) are found by their records.
        for record in (DEMO / "state").glob("*/shards/*.json"):
            try:
                os.killpg(int(json.loads(record.read_text())["pid"]), signal.SIGKILL)
            except (OSError, ValueError, KeyError):
                pass
    say("stopped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
