"""Calibrated defaults of the cost model's efficiencies and fixed latencies, per device class.

A node.yaml names each device's class (``gpus[].class``: consumer or datacenter; ``cpu.class``:
desktop or server); every ``efficiency`` / ``latency`` key it leaves out takes the value of the
class of the device it belongs to (``gpu_*`` from the GPU, ``cpu_*`` from the CPU, ``link*``
from the link table). One set of constants cannot fit every class: a consumer card reaches a
different fraction of its spec-sheet peaks than a power-capped datacenter part, a two-socket
server's DRAM than a desktop's.

The values are fitted, not chosen: ``python bench/published_accuracy.py --fit-classes`` fits
them to the published runs in ``bench/published/*.json`` (coordinate descent on the mean
|log(predicted / published)|, every constant informed by at least three points, with
leave-one-out errors); bench/RESULTS.md records the fit, its points and its errors, and the
README lists the data behind them. A measured profile (``hetplan profile``) replaces them.
"""

from __future__ import annotations

GPU_CLASSES = ("consumer", "datacenter")
CPU_CLASSES = ("desktop", "server")

GPU_KEYS = ("gpu_mem", "gpu_flops", "gpu_task")
CPU_KEYS = ("cpu_mem", "cpu_flops", "cpu_task")
LINK_KEYS = ("link", "link_task")
LATENCY_KEYS = ("gpu_task", "cpu_task", "link_task")
"""Keys of node.yaml's ``latency:`` table; the others belong to ``efficiency:``."""

CLASS_DEFAULTS: dict[str, dict[str, float]] = {
    "consumer": {"gpu_mem": 0.937, "gpu_flops": 0.84, "gpu_task": 2.13e-05},
    "datacenter": {"gpu_mem": 0.81, "gpu_flops": 0.392, "gpu_task": 3.75e-05},
    "desktop": {"cpu_mem": 0.667, "cpu_flops": 0.5, "cpu_task": 7.38e-05},
    "server": {"cpu_mem": 0.574, "cpu_flops": 0.232, "cpu_task": 0.000287},
    "link": {"link": 0.525, "link_task": 0.00011},
}
"""class -> constant -> value (efficiencies as fractions of the peak, latencies in seconds)."""


def class_defaults(gpu_class: str = "consumer", cpu_class: str = "desktop") -> tuple[dict, dict]:
    """(efficiency, latency_s) for a node whose GPU is of ``gpu_class`` and CPU of ``cpu_class``."""
    merged = {**CLASS_DEFAULTS[gpu_class], **CLASS_DEFAULTS[cpu_class], **CLASS_DEFAULTS["link"]}
    efficiency = {k: v for k, v in merged.items() if k not in LATENCY_KEYS}
    latency = {k: v for k, v in merged.items() if k in LATENCY_KEYS}
    return efficiency, latency


def class_table() -> str:
    """The README's table of the defaults (between ``<!-- device-classes:begin/end -->``)."""
    keys = ("gpu_mem", "gpu_flops", "gpu_task", "cpu_mem", "cpu_flops", "cpu_task", "link", "link_task")
    lines = ["| class | " + " | ".join(f"`{k}`" for k in keys) + " |", "| --- |" + " ---: |" * len(keys)]
    for c in (*GPU_CLASSES, *CPU_CLASSES, "link"):
        row = CLASS_DEFAULTS[c]
        cells = [("" if k not in row else f"{row[k] * 1e6:g} us" if k in LATENCY_KEYS else f"{row[k]:g}") for k in keys]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
