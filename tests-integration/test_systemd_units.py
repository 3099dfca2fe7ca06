"""deploy/systemd: the units pass `systemd-analyze verify`, are hardened, and start the
programs with flags the programs accept; the agent's unit leaves engines running.

systemd-analyze checks that ExecStart's binary exists, so the units are verified as
installed here: /opt/llmgw/bin/ replaced by this environment's bin directory.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from llmgw_testkit.cluster import bin_path

UNITS = Path(__file__).resolve().parent.parent / "deploy" / "systemd"
PROGRAMS = {
    "llmgw-agent.service": ("llmgw-agent", "run"),
    "llmgw-control.service": ("llmgw-control", "serve"),
    "llmgw-router.service": ("llmgw-router", "serve"),
}
# systemd-analyze security's exposure, 0 (locked down) to 100; the agent runs engines
# that need GPUs, JIT compilation and shared memory, so it is allowed more.
MAX_EXPOSURE = {"llmgw-agent.service": 50, "llmgw-control.service": 20, "llmgw-router.service": 20}


def systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.fail("systemd-analyze is missing: apt-get install -y systemd")
    return found


def directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The units as they would be installed, pointing at this environment's programs."""
    out = tmp_path_factory.mktemp("units")
    here = str(Path(bin_path("llmgw-agent")).parent) + "/"
    for unit in PROGRAMS:
        (out / unit).write_text((UNITS / unit).read_text().replace("/opt/llmgw/bin/", here))
    return out


def test_units_pass_systemd_analyze_verify(installed: Path) -> None:
    units = sorted(str(p) for p in installed.glob("*.service"))
    assert len(units) == 3
    result = subprocess.run(
        [systemd_analyze(), "verify", *units], capture_output=True, text=True, timeout=120
    )
    # Unknown keys and bad values are only warnings (exit 0): any line about our files fails.
    ours = [
        line for line in result.stderr.splitlines() if str(installed) in line or ".service" in line
    ]
    assert result.returncode == 0, result.stderr
    assert ours == [], "\n".join(ours)


def test_verify_catches_a_broken_unit(installed: Path, tmp_path: Path) -> None:
    broken = tmp_path / "llmgw-broken.service"
    text = (installed / "llmgw-agent.service").read_text()
    broken.write_text(text.replace("KillMode=process", "KillMode=procss"))
    result = subprocess.run(
        [systemd_analyze(), "verify", str(broken)], capture_output=True, text=True, timeout=120
    )
    assert "kill mode" in result.stderr.lower(), result.stderr


@pytest.mark.parametrize("unit", sorted(PROGRAMS))
def test_units_are_hardened(installed: Path, unit: str) -> None:
    result = subprocess.run(
        [systemd_analyze(), "security", "--offline=yes", str(installed / unit)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
    assert found, result.stdout + result.stderr
    exposure = float(found.group(1)) * 10
    print(f"{unit}: exposure {exposure:.0f}/100")
    assert exposure <= MAX_EXPOSURE[unit], result.stdout
    d = directives((UNITS / unit).read_text())
    assert d["User"] == ["llmgw"]
    assert d["NoNewPrivileges"] == ["yes"]
    assert d["ProtectSystem"] == ["strict"]


@pytest.mark.parametrize("unit", sorted(PROGRAMS))
def test_exec_start_uses_flags_the_program_accepts(unit: str) -> None:
    d = directives((UNITS / unit).read_text())
    (exec_start,) = d["ExecStart"]
    program, command = PROGRAMS[unit]
    argv = shlex.split(exec_start)
    assert argv[0] == f"/opt/llmgw/bin/{program}"
    assert argv[1] == command
    flags = [a for a in argv[2:] if a.startswith("--")]
    assert "--config" in flags
    # Every ${VAR} ExecStart uses has a default in the unit, so a missing env file is fine.
    defaults = {v.split("=", 1)[0] for v in d.get("Environment", [])}
    assert set(re.findall(r"\$\{(\w+)\}", exec_start)) <= defaults
    helptext = subprocess.run(
        [bin_path(program), command, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for flag in flags:
        assert re.search(rf"(^|\s){re.escape(flag)}\b", helptext), f"{program} {command}: {flag}?"


def test_agent_unit_lets_engines_survive_an_agent_restart() -> None:
    d = directives((UNITS / "llmgw-agent.service").read_text())
    # Only the agent's own process gets the stop signal; engines stay and are re-adopted.
    assert d["KillMode"] == ["process"]
    assert d["Restart"] == ["always"]
    # The shard records a new agent re-adopts from survive the restart.
    assert "llmgw-agent" in d["StateDirectory"]
    assert "XDG_STATE_HOME=/var/lib" in d["Environment"]
    # GPUs live in /dev, and engines JIT-compile kernels: neither may be locked away.
    assert d.get("PrivateDevices", ["no"]) == ["no"]
    assert d.get("MemoryDenyWriteExecute", ["no"]) == ["no"]
    # The agent's default state_dir under that XDG_STATE_HOME is the unit's StateDirectory.
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "from llmgw_agent.config import AgentConfig; print(AgentConfig().state_dir)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={"XDG_STATE_HOME": "/var/lib", "PATH": "/usr/bin:/bin"},
    )
    assert probe.stdout.strip() == "/var/lib/llmgw-agent"


def test_example_environment_file_names_only_what_the_units_read() -> None:
    example = (UNITS / "llmgw.env.example").read_text()
    names = set(re.findall(r"^#?([A-Z][A-Z0-9_]+)=", example, re.M))
    read = set()
    for unit in PROGRAMS:
        d = directives((UNITS / unit).read_text())
        assert d["EnvironmentFile"] == ["-/etc/llmgw/llmgw.env"]
        read |= {v.split("=", 1)[0] for v in d.get("Environment", [])}
    engine_env = {"HF_TOKEN", "HF_HUB_OFFLINE"}  # passed through the agent to its engines
    assert names - engine_env <= read, names - engine_env - read
