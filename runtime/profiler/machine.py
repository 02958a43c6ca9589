"""What this machine is, as torch and the OS report it: identity, caches, load, physical peaks.

The profile's machine record (``current_machine`` from ``hetplan.profile.checks``, with the GPUs
as torch sees them), the size of the cache a kernel's operands could stay in, the load average
while profiling, and the physical peaks the sanity checks compare measurements with: HBM from
the memory clock and bus width, PCIe from the link's generation and width in sysfs. Knows
nothing about measurements.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from hetplan.profile.checks import current_machine


def cache_bytes(device: str) -> int:
    """The last-level cache a kernel's operands could stay in between calls: the CPU's largest
    cache level (sysfs; 32 MiB if unknown), the GPU's L2."""
    if device == "gpu":
        return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or (64 << 20))
    best = 0
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        try:
            best = max(best, int(text.rstrip("KM")) * {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1))
        except ValueError:
            continue
    return best or (32 << 20)


def load_average() -> float | None:
    """The 1-minute load average (other work competing for the CPUs while measuring)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def machine_record(devices: tuple) -> dict:
    """current_machine(), with the GPUs as torch sees them and their physical peaks."""
    m = current_machine()
    m["threads"] = torch.get_num_threads()
    if "gpu" in devices:
        gpus = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            g = {"name": p.name, "memory_bytes": int(p.total_memory)}
            clock_khz, bus_bits = getattr(p, "memory_clock_rate", 0), getattr(p, "memory_bus_width", 0)
            if clock_khz and bus_bits:
                g["mem_peak_bytes_per_s"] = 2.0 * clock_khz * 1e3 * bus_bits / 8
            link = pcie_peak(p)
            if link:
                g["link_peak_bytes_per_s"] = link
            gpus.append(g)
        m["gpus"] = gpus
    elif m.get("gpus") is None:
        m["gpus"] = []
    return m


def pcie_peak(props) -> float | None:
    """Per-direction PCIe peak of the GPU's link from sysfs: GT/s * lanes * encoding / 8."""
    bus = getattr(props, "pci_bus_id", None)
    dom, dev = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", None)
    if bus is None or dev is None:
        return None
    root = Path(f"/sys/bus/pci/devices/{dom:04x}:{bus:02x}:{dev:02x}.0")
    try:
        gts = float((root / "max_link_speed").read_text().split()[0])
        lanes = int((root / "max_link_width").read_text().strip())
    except (OSError, ValueError, IndexError):
        return None
    encoding = 128 / 130 if gts >= 8 else 8 / 10
    return gts * 1e9 * lanes * encoding / 8
