"""What the node has: GPUs (through NVML), host CPU and memory, network interfaces.

NVML sits behind the small :class:`Nvml` protocol so tests substitute a fake
that raises the real ``pynvml.NVMLError`` subclasses. No NVML library, no
driver or no GPU gives an empty GPU list and a log line, never a crash: a
CPU-only node still runs llama.cpp shards.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import platform
import socket
import struct
import uuid as uuid_mod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pynvml
import structlog
from llmgw_proto import v1
from llmgw_proto.sizes import parse_size

from llmgw_agent.config import AgentConfig, SimulatedGpus
from llmgw_agent.disagg import rdma_devices

__all__ = [
    "GpuSource",
    "Nvml",
    "PyNvml",
    "collect_inventory",
    "host_info",
    "network_interfaces",
    "open_gpus",
]

log = structlog.get_logger(__name__)


class Nvml(Protocol):
    """The NVML calls the agent makes. Every method may raise ``pynvml.NVMLError``."""

    max_links: int

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def driver_version(self) -> str: ...
    def cuda_driver_version(self) -> int: ...
    def device_count(self) -> int: ...
    def handle(self, index: int) -> Any: ...
    def uuid(self, handle: Any) -> str: ...
    def name(self, handle: Any) -> str: ...
    def memory(self, handle: Any) -> tuple[int, int]: ...
    def pci_bus_id(self, handle: Any) -> str: ...
    def nvlink_active(self, handle: Any, link: int) -> bool: ...
    def nvlink_remote_bus_id(self, handle: Any, link: int) -> str: ...
    def utilization(self, handle: Any) -> int: ...


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


class PyNvml:
    """:class:`Nvml` on nvidia-ml-py."""

    max_links = int(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18))

    def init(self) -> None:
        pynvml.nvmlInit()

    def shutdown(self) -> None:
        pynvml.nvmlShutdown()

    def driver_version(self) -> str:
        return _text(pynvml.nvmlSystemGetDriverVersion())

    def cuda_driver_version(self) -> int:
        return int(pynvml.nvmlSystemGetCudaDriverVersion())

    def device_count(self) -> int:
        return int(pynvml.nvmlDeviceGetCount())

    def handle(self, index: int) -> Any:
        return pynvml.nvmlDeviceGetHandleByIndex(index)

    def uuid(self, handle: Any) -> str:
        return _text(pynvml.nvmlDeviceGetUUID(handle))

    def name(self, handle: Any) -> str:
        return _text(pynvml.nvmlDeviceGetName(handle))

    def memory(self, handle: Any) -> tuple[int, int]:
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return int(info.total), int(info.used)

    def pci_bus_id(self, handle: Any) -> str:
        return _text(pynvml.nvmlDeviceGetPciInfo(handle).busId)

    def nvlink_active(self, handle: Any, link: int) -> bool:
        return bool(pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED)

    def nvlink_remote_bus_id(self, handle: Any, link: int) -> str:
        return _text(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)

    def utilization(self, handle: Any) -> int:
        return int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)


def cuda_version_text(version: int) -> str:
    """NVML's 12080 is CUDA 12.8."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def simulated_gpus(spec: SimulatedGpus, node_id: str) -> list[v1.Gpu]:
    """Stable made-up GPUs: the same node id always gets the same uuids."""
    memory = parse_size(spec.memory)
    return [
        v1.Gpu(
            index=i,
            uuid=f"GPU-{uuid_mod.uuid5(uuid_mod.NAMESPACE_DNS, f'{node_id}.gpu{i}.llmgw-sim')}",
            name=spec.name,
            memory_total_bytes=memory,
            pci_bus_id=f"00000000:{0x18 + i:02X}:00.0",
        )
        for i in range(spec.count)
    ]


@dataclass
class GpuSource:
    """The node's GPUs, read once, and their live usage for heartbeats."""

    nvml: Nvml | None = None
    simulate: SimulatedGpus | None = None
    node_id: str = ""
    driver_version: str = ""
    cuda_version: str = ""
    gpus: list[v1.Gpu] = field(default_factory=list)
    _handles: dict[int, Any] = field(default_factory=dict)
    _ok: bool = False

    @property
    def simulated(self) -> bool:
        return self.simulate is not None

    def open(self) -> GpuSource:
        if self.simulate is not None:
            self.gpus = simulated_gpus(self.simulate, self.node_id)
            log.warning("using simulated GPUs", count=len(self.gpus), name=self.simulate.name)
            return self
        nvml = self.nvml if self.nvml is not None else PyNvml()
        try:
            nvml.init()
        except pynvml.NVMLError as err:
            log.info("NVML unavailable: no GPUs in the inventory", error=str(err))
            return self
        self.nvml = nvml
        self._ok = True
        try:
            self.driver_version = nvml.driver_version()
            self.cuda_version = cuda_version_text(nvml.cuda_driver_version())
        except pynvml.NVMLError as err:
            log.warning("NVML could not report driver versions", error=str(err))
        try:
            count = nvml.device_count()
        except pynvml.NVMLError as err:
            log.warning("NVML could not count GPUs: no GPUs in the inventory", error=str(err))
            return self
        for index in range(count):
            gpu = self._read_gpu(nvml, index)
            if gpu is not None:
                self.gpus.append(gpu)
        if not self.gpus:
            log.info("NVML found no usable GPU")
        return self

    def _read_gpu(self, nvml: Nvml, index: int) -> v1.Gpu | None:
        try:
            handle = nvml.handle(index)
            gpu = v1.Gpu(
                index=index,
                uuid=nvml.uuid(handle),
                name=nvml.name(handle),
                memory_total_bytes=nvml.memory(handle)[0],
            )
        except pynvml.NVMLError as err:
            # A lost or inaccessible GPU is left out; the rest of the node still serves.
            log.warning("skipping GPU that NVML cannot read", index=index, error=str(err))
            return None
        self._handles[index] = handle
        with contextlib.suppress(pynvml.NVMLError):
            gpu.pci_bus_id = nvml.pci_bus_id(handle)
        gpu.nvlink_peers = _nvlink_peers(nvml, handle)
        return gpu

    def usage(self) -> list[v1.GpuUsage]:
        """Memory used and utilization per GPU; a GPU NVML cannot read reports zeros."""
        out: list[v1.GpuUsage] = []
        for gpu in self.gpus:
            usage = v1.GpuUsage(index=gpu.index)
            handle = self._handles.get(gpu.index)
            if self.nvml is not None and handle is not None:
                with contextlib.suppress(pynvml.NVMLError):
                    usage.memory_used_bytes = self.nvml.memory(handle)[1]
                with contextlib.suppress(pynvml.NVMLError):
                    usage.utilization_percent = self.nvml.utilization(handle)
            out.append(usage)
        return out

    def memory(self) -> dict[int, tuple[int, int]]:
        """GPU index -> (total, free) bytes now (simulated GPUs are all free)."""
        used = {u.index: u.memory_used_bytes for u in self.usage()}
        return {
            g.index: (g.memory_total_bytes, max(0, g.memory_total_bytes - used.get(g.index, 0)))
            for g in self.gpus
        }

    def close(self) -> None:
        if self._ok and self.nvml is not None:
            with contextlib.suppress(pynvml.NVMLError):
                self.nvml.shutdown()
            self._ok = False


def _nvlink_peers(nvml: Nvml, handle: Any) -> list[str]:
    """Remote PCI bus ids of the active links, each once, in link order."""
    peers: list[str] = []
    for link in range(nvml.max_links):
        try:
            if not nvml.nvlink_active(handle, link):
                continue
            peer = nvml.nvlink_remote_bus_id(handle, link)
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
            # No NVLink on this GPU, or no link with this number: nothing further to find.
            break
        except pynvml.NVMLError as err:
            log.debug("NVLink query failed", link=link, error=str(err))
            continue
        if peer and peer not in peers:
            peers.append(peer)
    return peers


def _meminfo_total() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    with contextlib.suppress(ValueError, OSError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 0


def _os_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip().strip('"')
    return platform.system()


def host_info() -> v1.Host:
    return v1.Host(
        cpu_count=os.cpu_count() or 0,
        memory_total_bytes=_meminfo_total(),
        os=_os_name(),
        kernel=platform.release(),
    )


_SIOCGIFADDR = 0x8915


def _ipv4_address(sock: socket.socket, name: str) -> str | None:
    """The interface's (primary) IPv4 address, via the SIOCGIFADDR ioctl."""
    request = struct.pack("256s", name.encode()[:15])
    try:
        reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
    except OSError:
        return None  # no IPv4 address on this interface
    return socket.inet_ntoa(reply[20:24])


def _ipv6_addresses(path: Path = Path("/proc/net/if_inet6")) -> dict[str, list[str]]:
    """IPv6 addresses per interface; link-local ones are left out (no zone, not dialable)."""
    out: dict[str, list[str]] = {}
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) < 6:
                continue
            address = ipaddress.IPv6Address(bytes.fromhex(parts[0]))
            if address.is_link_local:
                continue
            out.setdefault(parts[5], []).append(str(address))
    return out


def network_interfaces() -> list[v1.NetworkInterface]:
    """Every interface with its IPv4 address first, then IPv6; ``lo`` included."""
    ipv6 = _ipv6_addresses()
    result: list[v1.NetworkInterface] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in sorted(socket.if_nameindex()):
            addresses: list[str] = []
            ipv4 = _ipv4_address(sock, name)
            if ipv4:
                addresses.append(ipv4)
            addresses.extend(ipv6.get(name, []))
            result.append(v1.NetworkInterface(name=name, addresses=addresses))
    return result


def collect_inventory(config: AgentConfig, gpus: GpuSource) -> v1.Inventory:
    """The whole inventory as sent in Register."""
    return v1.Inventory(
        hostname=socket.gethostname(),
        gpus=list(gpus.gpus),
        host=host_info(),
        interfaces=network_interfaces(),
        driver_version=gpus.driver_version,
        cuda_version=gpus.cuda_version,
        simulated=gpus.simulated,
        rdma_devices=list(rdma_devices()),
    )


def open_gpus(config: AgentConfig, nvml: Nvml | None = None) -> GpuSource:
    return GpuSource(nvml=nvml, simulate=config.simulate_gpus, node_id=config.node_name).open()
