"""deploy/systemd (issue 29 point 11): under ProtectSystem=strict every unit can still
write /tmp and /var/tmp (PrivateTmp=yes, or both in ReadWritePaths), and the agent's
engines find a writable home for what they cache under ~.

ProtectSystem=strict mounts the whole tree read-only but /dev, /proc and /sys; the
agent's unit had neither PrivateTmp nor /tmp in ReadWritePaths while its comment said
/tmp stayed shared with the engines.
"""

from __future__ import annotations

from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parent.parent / "deploy" / "systemd"


def directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def writable(d: dict[str, list[str]]) -> list[str]:
    paths = [p.lstrip("-") for value in d.get("ReadWritePaths", []) for p in value.split()]
    for kind, root in (("StateDirectory", "/var/lib/"), ("CacheDirectory", "/var/cache/")):
        paths += [root + name for value in d.get(kind, []) for name in value.split()]
    return paths


def under(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


@pytest.mark.parametrize("unit", sorted(p.name for p in UNITS.glob("*.service")))
def test_tmp_is_writable_under_protect_system_strict(unit: str) -> None:
    d = directives((UNITS / unit).read_text())
    if d.get("ProtectSystem", [""])[-1] != "strict":
        pytest.skip(f"{unit} does not mount the system read-only")
    private = d.get("PrivateTmp", ["no"])[-1] in ("yes", "true", "1")
    paths = writable(d)
    for tmp in ("/tmp", "/var/tmp"):
        assert private or under(tmp, paths), (
            f"{unit}: {tmp} is read-only under ProtectSystem=strict"
        )


def test_agent_keeps_tmp_shared_and_gives_engines_a_writable_home() -> None:
    text = (UNITS / "llmgw-agent.service").read_text()
    d = directives(text)
    # Engines outlive an agent restart (KillMode=process): a private /tmp would be
    # emptied under them when the unit stops, so /tmp is shared and writable instead.
    assert d["KillMode"] == ["process"]
    assert d.get("PrivateTmp", ["no"])[-1] == "no"
    assert under("/tmp", writable(d))
    assert "PrivateTmp" in text  # the comment says why it is not used
    homes = [v.split("=", 1)[1] for v in d.get("Environment", []) if v.startswith("HOME=")]
    assert homes, "HOME unset: engines write ~/.cache and ~/.triton under a read-only /home"
    assert under(homes[-1], writable(d)), homes
