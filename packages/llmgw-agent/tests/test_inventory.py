from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pynvml
import pytest
from llmgw_agent.config import SimulatedGpus, load_agent_config
from llmgw_agent.inventory import (
    GpuSource,
    PyNvml,
    collect_inventory,
    cuda_version_text,
    host_info,
    network_interfaces,
    simulated_gpus,
)
from llmgw_proto.logs import setup_logging

H200 = 141 * 1024**3


def test_gpus_with_nvlink_peers_and_versions(kit: Any) -> None:
    nvml = kit.FakeNvml(
        [
            kit.FakeGpu(
                "GPU-a",
                bus_id="00000000:18:00.0",
                links={0: "00000000:2A:00.0", 1: "00000000:2A:00.0", 3: "00000000:3B:00.0"},
            ),
            kit.FakeGpu("GPU-b", bus_id="00000000:2A:00.0", links={}),
        ]
    )
    source = GpuSource(nvml=nvml).open()
    assert [g.uuid for g in source.gpus] == ["GPU-a", "GPU-b"]
    first = source.gpus[0]
    assert first.index == 0
    assert first.name == "NVIDIA H200"
    assert first.memory_total_bytes == H200
    assert first.pci_bus_id == "00000000:18:00.0"
    # Two links to the same peer list it once; inactive links are skipped.
    assert first.nvlink_peers == ["00000000:2A:00.0", "00000000:3B:00.0"]
    assert source.gpus[1].nvlink_peers == []
    assert source.driver_version == "570.86.15"
    assert source.cuda_version == "12.8"
    assert not source.simulated
    source.close()
    assert nvml.shutdowns == 1


def test_gpu_without_nvlink_support(kit: Any) -> None:
    # NVML raises NVMLError_NotSupported for NVLink on, say, an L40S.
    source = GpuSource(nvml=kit.FakeNvml([kit.FakeGpu("GPU-l40s", links=None)])).open()
    assert len(source.gpus) == 1
    assert source.gpus[0].nvlink_peers == []


@pytest.mark.parametrize(
    "error",
    [
        pynvml.NVMLError_LibraryNotFound(),
        pynvml.NVMLError_DriverNotLoaded(),
        pynvml.NVMLError_NoPermission(),
    ],
)
def test_no_nvml_gives_empty_list_and_a_log_line(
    kit: Any, error: pynvml.NVMLError, capsys: pytest.CaptureFixture[str]
) -> None:
    setup_logging("info", "json")  # onto the captured stderr
    source = GpuSource(nvml=kit.FakeNvml(init_error=error)).open()
    assert source.gpus == []
    assert source.usage() == []
    line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert line["event"] == "NVML unavailable: no GPUs in the inventory"
    assert line["error"] == str(error)
    source.close()  # nothing to shut down, and no crash


def test_count_failure_gives_empty_list(kit: Any) -> None:
    source = GpuSource(nvml=kit.FakeNvml(count_error=pynvml.NVMLError_Unknown())).open()
    assert source.gpus == []
    assert source.driver_version == "570.86.15"


def test_lost_gpu_is_skipped_others_kept(kit: Any) -> None:
    nvml = kit.FakeNvml(
        [
            kit.FakeGpu("GPU-a"),
            kit.FakeGpu("GPU-lost", errors={"uuid": pynvml.NVMLError_GpuIsLost()}),
            kit.FakeGpu("GPU-c"),
        ]
    )
    source = GpuSource(nvml=nvml).open()
    assert [(g.index, g.uuid) for g in source.gpus] == [(0, "GPU-a"), (2, "GPU-c")]


def test_unreadable_bus_id_and_nvlink_errors_do_not_drop_gpu(kit: Any) -> None:
    gpu = kit.FakeGpu(
        "GPU-a",
        links={0: "x"},
        errors={
            "pci_bus_id": pynvml.NVMLError_NotSupported(),
            "nvlink_remote_bus_id": pynvml.NVMLError_Unknown(),
        },
    )
    source = GpuSource(nvml=kit.FakeNvml([gpu])).open()
    assert source.gpus[0].pci_bus_id == ""
    assert source.gpus[0].nvlink_peers == []


def test_usage_for_heartbeats(kit: Any) -> None:
    nvml = kit.FakeNvml(
        [
            kit.FakeGpu("GPU-a", used=10 * 1024**3, util=87),
            kit.FakeGpu("GPU-b", used=5, errors={"utilization": pynvml.NVMLError_NotSupported()}),
        ]
    )
    source = GpuSource(nvml=nvml).open()
    nvml.gpus[0].used = 20 * 1024**3  # live figures, read at each heartbeat
    usage = source.usage()
    assert [(u.index, u.memory_used_bytes, u.utilization_percent) for u in usage] == [
        (0, 20 * 1024**3, 87),
        (1, 5, 0),
    ]


def test_real_pynvml_without_library_is_empty() -> None:
    # This machine has no NVIDIA driver: the real binding raises LibraryNotFound (or,
    # on a GPU machine, works). Either way: no crash.
    source = GpuSource(nvml=PyNvml()).open()
    try:
        for gpu in source.gpus:
            assert gpu.uuid.startswith("GPU-")
    finally:
        source.close()


def test_simulated_gpus_are_stable_and_flagged() -> None:
    spec = SimulatedGpus(count=4, name="NVIDIA H200", memory="141GiB")
    a = simulated_gpus(spec, "node-a")
    assert [g.index for g in a] == [0, 1, 2, 3]
    assert all(g.memory_total_bytes == H200 for g in a)
    assert len({g.uuid for g in a}) == 4
    assert [g.uuid for g in a] == [g.uuid for g in simulated_gpus(spec, "node-a")]
    assert a[0].uuid != simulated_gpus(spec, "node-b")[0].uuid
    source = GpuSource(simulate=spec, node_id="node-a").open()
    assert source.simulated
    assert [u.memory_used_bytes for u in source.usage()] == [0, 0, 0, 0]


def test_cuda_version_text() -> None:
    assert cuda_version_text(12080) == "12.8"
    assert cuda_version_text(11040) == "11.4"
    assert cuda_version_text(13000) == "13.0"


def test_host_and_interfaces() -> None:
    host = host_info()
    assert host.cpu_count >= 1
    assert host.memory_total_bytes > 0
    assert host.kernel
    interfaces = {i.name: i.addresses for i in network_interfaces()}
    assert interfaces["lo"][0] == "127.0.0.1"


def test_inventory_carries_labels_simulation_and_host(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("node_id: n1\nsimulate_gpus: {count: 2}\ncontrol: {tls: {insecure: true}}\n")
    config = load_agent_config(path)
    source = GpuSource(simulate=config.simulate_gpus, node_id=config.node_name).open()
    inventory = collect_inventory(config, source)
    assert inventory.simulated
    assert len(inventory.gpus) == 2
    assert inventory.host is not None
    assert inventory.host.cpu_count >= 1
    assert any(i.name == "lo" and "127.0.0.1" in i.addresses for i in inventory.interfaces)


def test_inventory_cli_json(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(
        "node_id: n1\nlabels: {fabric.nvlink-domain: d1}\n"
        "simulate_gpus: {count: 2, name: NVIDIA H200, memory: 141GiB}\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "llmgw_agent", "inventory", "--json", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    data = json.loads(out.stdout)
    assert data["node_id"] == "n1"
    assert data["labels"] == {"fabric.nvlink-domain": "d1"}
    assert data["inventory"]["simulated"] is True
    assert [g["name"] for g in data["inventory"]["gpus"]] == ["NVIDIA H200"] * 2
    assert int(data["inventory"]["gpus"][0]["memory_total_bytes"]) == H200
    assert any(i["name"] == "lo" for i in data["inventory"]["interfaces"])


def test_inventory_cli_human_and_bad_config(tmp_path: Path) -> None:
    good = subprocess.run(
        [sys.executable, "-m", "llmgw_agent", "inventory"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "interface   lo: 127.0.0.1" in good.stdout
    bad = tmp_path / "agent.yaml"
    bad.write_text("simulate_gpus: {count: many}\n")
    out = subprocess.run(
        [sys.executable, "-m", "llmgw_agent", "inventory", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert f"{bad}: $.simulate_gpus.count" in out.stderr
    assert "Traceback" not in out.stderr
