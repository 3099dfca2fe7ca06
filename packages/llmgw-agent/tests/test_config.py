from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from llmgw_agent.config import load_agent_config, parse_size
from llmgw_proto.config import ConfigError


def write(tmp_path: Path, text: str, name: str = "agent.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_need_tls_or_insecure() -> None:
    with pytest.raises(ConfigError, match=r"\$\.control\.tls\.cert: required unless"):
        load_agent_config(None)
    config = load_agent_config(None, insecure=True)
    assert config.control.address == "127.0.0.1:7070"
    assert config.control.tls.insecure
    assert config.engines.vllm.command == ["vllm"]
    assert config.engines.sglang.command == ["python", "-m", "sglang.launch_server"]
    assert config.engines.llamacpp.command == ["llama-server"]
    assert config.stop_engines_on_exit is False
    # Engines bind the advertised address by default, not every address of the node.
    assert config.engine_host == ""
    assert config.bind_host() == config.endpoint_host()
    assert config.node_name  # the hostname


def test_full_config(tmp_path: Path) -> None:
    for name in ("n.crt", "n.key", "ca.crt"):
        (tmp_path / name).write_text("-")
    path = write(
        tmp_path,
        f"""
node_id: gpu-7
control:
  address: 10.0.0.1:7070
  tls: {{cert: {tmp_path}/n.crt, key: {tmp_path}/n.key, ca: {tmp_path}/ca.crt}}
labels: {{fabric.nvlink-domain: nvl72-a, fabric.ib-subnet: ib-3}}
simulate_gpus: {{count: 4, name: NVIDIA H200, memory: 141GiB}}
engine_host: 127.0.0.1
engines:
  vllm: {{command: [llmgw-sim, vllm]}}
state_dir: /tmp/x
stop_grace: 5s
load_timeout: 2m
base_backoff: 100ms
max_backoff: 10s
stop_engines_on_exit: true
""",
    )
    config = load_agent_config(path)
    assert config.node_name == "gpu-7"
    assert config.labels["fabric.nvlink-domain"] == "nvl72-a"
    assert config.simulated_memory_bytes == 141 * 1024**3
    assert config.engines.vllm.command == ["llmgw-sim", "vllm"]
    assert config.engines.llamacpp.command == ["llama-server"]
    assert config.stop_grace == 5.0
    assert config.load_timeout == 120.0
    assert config.base_backoff == 0.1
    assert config.endpoint_host() == "127.0.0.1"


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("nodeid: x\n", "$: Object contains unknown field `nodeid`"),
        (
            "control: {address: nohost, tls: {insecure: true}}\n",
            "$.control.address: expected HOST:PORT",
        ),
        ("stop_grace: soon\n", "$.stop_grace"),
        ("simulate_gpus: {count: 2, memory: lots}\n", "$.simulate_gpus.memory"),
        ("simulate_gpus: {count: -1}\n", "$.simulate_gpus.count"),
        ("engines: {vllm: {command: []}}\n", "$.engines.vllm.command"),
        ("labels: {a: 1}\n", "$.labels.a"),
        ("base_backoff: 5s\nmax_backoff: 1s\n", "$.max_backoff"),
        (
            "control: {tls: {insecure: true}, keepalive: 0s}\n",
            "$.control.keepalive: must be >= 10ms",
        ),
        (
            "control: {tls: {insecure: true}, keepalive_timeout: 0s}\n",
            "$.control.keepalive_timeout: must be >= 10ms",
        ),
    ],
)
def test_errors_name_file_and_field(tmp_path: Path, text: str, where: str) -> None:
    path = write(
        tmp_path, "control: {tls: {insecure: true}}\n" + text if "control" not in text else text
    )
    with pytest.raises(ConfigError) as info:
        load_agent_config(path)
    assert str(info.value).startswith(str(path) + ": ")
    assert where in str(info.value)


def test_insecure_flag_overrides_file(tmp_path: Path) -> None:
    path = write(tmp_path, "control: {address: 127.0.0.1:9999}\n")
    config = load_agent_config(path, insecure=True)
    assert config.control.tls.insecure
    assert config.control.address == "127.0.0.1:9999"


def test_wildcard_engine_host_advertises_hostname() -> None:
    config = load_agent_config(None, insecure=True)
    import socket

    assert config.endpoint_host() == socket.gethostname()


def test_engines_bind_the_advertised_address() -> None:
    import socket

    config = load_agent_config(None, insecure=True)
    assert config.bind_host() == socket.gethostname()
    advertised = msgspec.structs.replace(config, advertise_host="10.0.0.5")
    assert advertised.bind_host() == "10.0.0.5"
    # An explicit engine_host is the operator's choice, a wildcard included.
    wildcard = msgspec.structs.replace(advertised, engine_host="0.0.0.0")
    assert (wildcard.bind_host(), wildcard.endpoint_host()) == ("0.0.0.0", "10.0.0.5")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80GiB", 80 * 1024**3), ("141GB", 141 * 10**9), ("512MiB", 512 * 1024**2), ("1024", 1024)],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@given(st.integers(min_value=0, max_value=10**6), st.sampled_from(["KiB", "MiB", "GiB", "TiB"]))
def test_parse_size_binary_units(n: int, unit: str) -> None:
    factor = {"KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}[unit]
    assert parse_size(f"{n}{unit}") == n * factor


def test_missing_certificate_file_names_file_field_and_path(tmp_path: Path) -> None:
    (tmp_path / "n.key").write_text("-")
    (tmp_path / "ca.crt").write_text("-")
    tls = f"{{cert: {tmp_path}/gone.crt, key: {tmp_path}/n.key, ca: {tmp_path}/ca.crt}}"
    path = write(tmp_path, f"control: {{tls: {tls}}}\n")
    with pytest.raises(ConfigError) as info:
        load_agent_config(path)
    assert str(info.value) == f"{path}: $.control.tls.cert: no such file: {tmp_path}/gone.crt"


def test_several_control_addresses(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "control: {tls: {insecure: true}, addresses: [10.0.0.1:7070, '[fd00::1]:7070']}\n",
    )
    assert load_agent_config(path).control_addresses() == ["10.0.0.1:7070", "[fd00::1]:7070"]
    bad = write(tmp_path, "control: {tls: {insecure: true}, addresses: [10.0.0.1]}\n", "b.yaml")
    with pytest.raises(ConfigError, match=r"\$\.control\.addresses\[0\]: expected HOST:PORT"):
        load_agent_config(bad)
