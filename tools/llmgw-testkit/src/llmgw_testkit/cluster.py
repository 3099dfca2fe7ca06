"""A whole llmgw system on loopback: control plane, agents with simulated GPUs, router.

The integration suite and the demo both use it. Every program runs as a real
process started from its console script; configs are written as YAML files the
way an operator writes them; streams run over mutual TLS with certificates made
by ``llmgw-control ca`` unless the cluster is made ``insecure``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from llmgw_testkit import Proc, engine_port_range, free_port, wait_for

__all__ = ["Cluster", "SystemView", "bin_path", "metric_sum", "poll", "vllm_profile"]


def bin_path(name: str) -> str:
    """A console script of the running environment (the venv nox or the test made)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def _yaml(data: object) -> str:
    # JSON is YAML: no YAML writer needed, and the files stay exact.
    return json.dumps(data, indent=2) + "\n"


def vllm_profile(
    *,
    gpus: int = 1,
    nodes: int = 1,
    replicas: int | dict[str, int] = 1,
    args: Iterable[str] = (),
    env: dict[str, str] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A vLLM profile whose engines are simulated with small, quick delays."""
    sim_env = {"LLMGW_SIM_ITL": "0.005", "LLMGW_SIM_LOAD_TIME": "0.3"}
    sim_env.update(env or {})
    profile: dict[str, Any] = {
        "engine": "vllm",
        "model_ref": "sim/model",
        "engine_args": list(args),
        "env": sim_env,
        "gpus_per_node": gpus,
        "nodes": nodes,
        "replicas": replicas,
        "load_timeout": "60s",
    }
    profile.update(extra)
    return profile


class SystemView:
    """Read the state of a running system: the control plane's admin API and the router."""

    def __init__(self, admin_port: int, router_port: int, router_admin_port: int) -> None:
        self.admin_port = admin_port
        self.router_port = router_port
        self.router_admin_port = router_admin_port
        self.control: Proc | None = None

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    @staticmethod
    def _died(proc: Proc | None) -> bool:
        if proc is not None and not proc.alive():
            raise AssertionError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
        return False

    @staticmethod
    def _healthy(port: int, path: str) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
                return int(resp.status) == 200
        except OSError:
            return False

    def admin(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}{path}", timeout=5) as resp:
            return json.loads(resp.read())

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = self.admin("/v1/status")
        return result

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.admin_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return str(resp.read().decode())

    def router_metrics(self) -> str:
        """The router's Prometheus text (its admin listener's /metrics)."""
        url = f"http://127.0.0.1:{self.router_admin_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return str(resp.read().decode())

    def node(self, node_id: str) -> dict[str, Any] | None:
        return next((n for n in self.status()["nodes"] if n["node_id"] == node_id), None)

    def replicas(self, model: str) -> list[dict[str, Any]]:
        return [r for r in self.status()["replicas"] if r["model"] == model]

    def wait_replicas(
        self, model: str, count: int, *, state: str = "ready", timeout: float = 60.0
    ) -> list[dict[str, Any]]:
        def enough() -> list[dict[str, Any]] | None:
            self._died(self.control)
            found = [r for r in self.replicas(model) if r["state"] == state]
            return found if len(found) >= count else None

        return wait_for(enough, timeout=timeout, what=f"{count} {state} replica(s) of {model}")

    def wait_node_state(self, node_id: str, state: str, timeout: float = 60.0) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            node = self.node(node_id)
            return node if node is not None and node["state"] == state else None

        return wait_for(reached, timeout=timeout, what=f"node {node_id} {state}")

    def router_models(self) -> set[str]:
        with urllib.request.urlopen(f"{self.router_url}/v1/models", timeout=5) as resp:  # noqa: S310
            return {m["id"] for m in json.loads(resp.read())["data"]}

    def wait_router_models(self, *models: str, timeout: float = 60.0) -> None:
        """Until the router lists ``models`` and is ready: with workers, /readyz answers
        200 only once every worker has had endpoints (one worker listing the models says
        nothing of the others, which the kernel hands connections to as well)."""
        wait_for(
            lambda: (
                set(models) <= self.router_models()
                and self._healthy(self.router_admin_port, "/readyz")
            ),
            timeout=timeout,
            what=f"router serving {', '.join(models)}",
        )


class Cluster(SystemView):
    """Start, inspect and stop the programs of one llmgw system under ``workdir``."""

    def __init__(
        self,
        workdir: Path,
        *,
        insecure: bool = False,
        timings: dict[str, Any] | None = None,
    ) -> None:
        self.workdir = workdir
        self.insecure = insecure
        self.logs = workdir / "logs"
        self.certs = workdir / "certs"
        super().__init__(free_port(), free_port(), free_port())
        self.grpc_port = free_port()
        self.router: Proc | None = None
        self.agents: dict[str, Proc] = {}
        self._procs: list[Proc] = []
        self.timings: dict[str, Any] = {
            "interval": "200ms",
            "base_backoff": "1s",
            "max_backoff": "8s",
            "unreachable_after": "2s",
            "lost_after": "5s",
            "startup_grace": "1s",
            "heartbeat_interval": "500ms",
            "mgmt_interface": "lo",
            "drain_timeout": "30s",
            "stop_grace": "5s",
            "command_timeout": "10s",
        }
        # Engine ports: a block of our own (apart from other xdist workers' and free_port()'s).
        self.timings["port_range"] = list(engine_port_range())
        self.timings.update(timings or {})
        # Top-level control.yaml sections merged over the defaults (state:, ha:, ...).
        self.control_extra: dict[str, Any] = {}
        # Several control-plane instances (HA): agents and routers get every address.
        self.control_addresses: list[str] = []
        if not insecure:
            self.make_certs()

    # -- certificates -------------------------------------------------------

    def ca(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [bin_path("llmgw-control"), "ca", *args, "--dir", str(self.certs)],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def make_certs(self) -> None:
        if (self.certs / "ca.crt").exists():
            return
        self.ca("init")
        self.ca("issue", "--server", "localhost,127.0.0.1")

    def node_cert(self, name: str) -> dict[str, str]:
        if not (self.certs / f"node-{name}.crt").exists():
            self.ca("issue", "--node", name)
        return self._tls(f"node-{name}")

    def router_cert(self, name: str) -> dict[str, str]:
        if not (self.certs / f"router-{name}.crt").exists():
            self.ca("issue", "--router", name)
        return self._tls(f"router-{name}")

    def _tls(self, stem: str) -> dict[str, str]:
        return {
            "cert": str(self.certs / f"{stem}.crt"),
            "key": str(self.certs / f"{stem}.key"),
            "ca": str(self.certs / "ca.crt"),
        }

    # -- programs -----------------------------------------------------------

    def _start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        proc = Proc(argv, log_dir=self.logs, name=name, env=env, grace=15.0)
        self._procs.append(proc)
        return proc

    def write(self, name: str, data: object) -> Path:
        path = self.workdir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_yaml(data))
        return path

    def control_config(self, models: list[dict[str, Any]]) -> dict[str, Any]:
        config: dict[str, Any] = {
            "listen": f"127.0.0.1:{self.grpc_port}",
            "admin_listen": f"127.0.0.1:{self.admin_port}",
            "control": dict(self.timings),
            "models": models,
        }
        config["tls"] = {"insecure": True} if self.insecure else self._tls("server-localhost")
        # The control plane's state store (SQLite); a restarted control plane reads it back.
        config["state"] = {"state_dir": str(self.workdir / "control-state")}
        config.update(self.control_extra)
        return config

    def start_control(self, models: list[dict[str, Any]], *, wait: bool = True) -> Proc:
        path = self.write("control.yaml", self.control_config(models))
        argv = [bin_path("llmgw-control"), "serve", "--config", str(path), "--log-format", "json"]
        self.control = self._start("control", argv)
        if wait:
            wait_for(
                lambda: self._healthy(self.admin_port, "/healthz") or self._died(self.control),
                timeout=30,
                what="control plane /healthz",
            )
        return self.control

    def agent_config(
        self, node_id: str, *, gpus: int = 8, labels: dict[str, str] | None = None, **extra: Any
    ) -> dict[str, Any]:
        config: dict[str, Any] = {
            "node_id": node_id,
            "control": {
                "address": f"127.0.0.1:{self.grpc_port}",
                "tls": {"insecure": True} if self.insecure else self.node_cert(node_id),
                **({"addresses": self.control_addresses} if self.control_addresses else {}),
            },
            "labels": labels or {},
            "simulate_gpus": {"count": gpus, "name": "NVIDIA H200", "memory": "141GB"},
            "engine_host": "127.0.0.1",
            "engines": {
                # The simulator takes the captured real engines' flags (llmgw_agent/engine_help).
                "vllm": {"command": [bin_path("llmgw-sim"), "vllm"], "flags_from": "captured"},
                "sglang": {"command": [bin_path("llmgw-sim"), "sglang"]},
                "llamacpp": {
                    "command": [bin_path("llmgw-sim"), "llama-server"],
                    "flags_from": "captured",
                },
            },
            "state_dir": str(self.state_dir(node_id)),
            "stop_grace": "5s",
            "health_interval": "100ms",
            "drain_poll_interval": "100ms",
            "base_backoff": "200ms",
            "max_backoff": "2s",
        }
        config.update(extra)
        return config

    def state_dir(self, node_id: str) -> Path:
        return self.workdir / "state" / node_id

    def start_agent(
        self, node_id: str, *, gpus: int = 8, labels: dict[str, str] | None = None, **extra: Any
    ) -> Proc:
        path = self.write(
            f"agent-{node_id}.yaml", self.agent_config(node_id, gpus=gpus, labels=labels, **extra)
        )
        argv = [bin_path("llmgw-agent"), "run", "--config", str(path), "--log-format", "json"]
        proc = self._start(f"agent-{node_id}", argv)
        self.agents[node_id] = proc
        return proc

    def router_config(self, **extra: Any) -> dict[str, Any]:
        config: dict[str, Any] = {
            "listen": f"127.0.0.1:{self.router_port}",
            "admin_listen": f"127.0.0.1:{self.router_admin_port}",
            "control": {
                "address": f"127.0.0.1:{self.grpc_port}",
                "router_id": "it-router",
                "tls": {"insecure": True} if self.insecure else self.router_cert("it-router"),
                "backoff_base": "200ms",
                "backoff_cap": "2s",
                **({"addresses": self.control_addresses} if self.control_addresses else {}),
            },
            "health_checks": {"interval": "500ms"},
        }
        config.update(extra)
        return config

    def start_router(self, **extra: Any) -> Proc:
        path = self.write("router.yaml", self.router_config(**extra))
        argv = [bin_path("llmgw-router"), "serve", "--config", str(path), "--log-format", "json"]
        self.router = self._start("router", argv)
        wait_for(
            lambda: self._healthy(self.router_admin_port, "/healthz") or self._died(self.router),
            timeout=30,
            what="router /healthz",
        )
        return self.router

    # -- stopping -----------------------------------------------------------

    def engine_pids(self) -> list[int]:
        """Engines recorded by any agent of this cluster (they outlive a killed agent)."""
        pids: list[int] = []
        for record in (self.workdir / "state").glob("*/shards/*.json"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                pids.append(int(json.loads(record.read_text())["pid"]))
        return pids

    def kill_engines(self) -> None:
        for pid in self.engine_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)

    def stop(self) -> None:
        """Stop every program, then any engine left behind, whatever state things are in."""
        pids = set(self.engine_pids())
        for proc in reversed(self._procs):
            proc.stop()
        for pid in pids | set(self.engine_pids()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def poll(fn: Callable[[], Any], seconds: float) -> list[Any]:
    """Call ``fn`` repeatedly for ``seconds``; for observing that something stays true."""
    out: list[Any] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        out.append(fn())
        time.sleep(0.1)
    return out


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of every sample of ``name`` in Prometheus text whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        if metric != name:
            continue
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total += float(value)
    return total
