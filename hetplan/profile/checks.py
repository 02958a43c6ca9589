"""Sanity of a profile: values that cannot be true, and machines that are not this one.

A measured value is impossible when it is zero, negative, not finite, or faster than the
hardware can physically go. Physical peaks come from the machine record when the profiler could
read them (the GPU's memory clock and bus width, its PCIe link generation and width) and
otherwise from ceilings no current part reaches:

- DRAM read bandwidth <= min(4 TB/s, cores * 768 GB/s): no socket pair carries more DRAM
  channels than that, and one core loads at most 2 x 64 bytes per cycle at 6 GHz;
- bytes touched by one op per second <= cores * 768 GB/s on the CPU (caches included),
  50 TB/s on a GPU (on-chip L2);
- CPU FLOP/s <= cores * 6 GHz * (64 fp32 | 2048 bf16/fp16 | 4096 for the quantised formats)
  per cycle (two AVX-512 FMAs; AMX tiles; AMX int8 tiles, which the quantised formats' kernels
  may multiply in: two AVX-512 VNNI dot products already give 256); GPU FLOP/s <= 10 PFLOP/s;
- GPU memory <= its measured peak, else 10 TB/s; links <= the PCIe link's peak
  (GT/s * lanes * 128/130 / 8), else 1 TB/s.

The machine identity (CPU model, logical CPUs, memory, GPU models) is read from /proc and
sysconf without torch, so a plan compiled anywhere can tell whether a profile was measured on
the machine it is compiling on. Knows nothing about how values were measured.
"""

from __future__ import annotations

import math
import os
import platform
from pathlib import Path

from hetplan.dtypes import QUANTISED
from hetplan.units import format_bytes

CORE_BYTES_PER_S = 768e9
CORE_FLOPS_PER_S = {"fp32": 6e9 * 64, "bf16": 6e9 * 2048, "fp16": 6e9 * 2048,
                    **{q: 6e9 * 4096 for q in QUANTISED}}
DRAM_CEILING_BYTES_PER_S = 4e12
GPU_MEM_CEILING_BYTES_PER_S = 1e13
GPU_ONCHIP_CEILING_BYTES_PER_S = 5e13
GPU_FLOPS_CEILING = 1e16
LINK_CEILING_BYTES_PER_S = 1e12


def physical_limits(machine: dict) -> dict:
    """Upper bounds (SI) for the quantities a profile records, from ``machine`` where it knows them."""
    cores = max(1, int(machine.get("cpu_count") or 1))
    gpu = (machine.get("gpus") or [{}])[0]
    lim = {"cpu.mem_bandwidth": min(DRAM_CEILING_BYTES_PER_S, cores * CORE_BYTES_PER_S),
           "cpu.op_bytes_per_s": cores * CORE_BYTES_PER_S,
           "gpu.mem_bandwidth": gpu.get("mem_peak_bytes_per_s") or GPU_MEM_CEILING_BYTES_PER_S,
           "gpu.op_bytes_per_s": GPU_ONCHIP_CEILING_BYTES_PER_S,
           "gpu.flops": GPU_FLOPS_CEILING,
           "link": gpu.get("link_peak_bytes_per_s") or LINK_CEILING_BYTES_PER_S}
    for dtype, per_core in CORE_FLOPS_PER_S.items():
        lim[f"cpu.flops.{dtype}"] = cores * per_core
    return lim


def _limit_for(name: str, lim: dict) -> float | None:
    """The bound that applies to a node.yaml path such as ``gpus[0].flops.bf16``."""
    if name.startswith("cpu.flops."):
        return lim.get(name, lim["cpu.flops.fp32"])
    if name == "cpu.mem_bandwidth":
        return lim[name]
    if name.startswith("gpus[") and name.endswith(".mem_bandwidth"):
        return lim["gpu.mem_bandwidth"]
    if name.startswith("gpus[") and ".flops." in name:
        return lim["gpu.flops"]
    if name.startswith("links."):
        return lim["link"]
    return None


def peak_problems(peaks: dict, machine: dict) -> list[str]:
    """Problems with measured peaks ``{node.yaml path: SI value}``: zero, negative, not finite,
    or above the physical peak."""
    lim = physical_limits(machine)
    out = []
    for name, v in sorted(peaks.items()):
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            out.append(f"{name} = {v!r} (must be a positive finite number)")
            continue
        bound = _limit_for(name, lim)
        if bound is not None and v > bound:
            out.append(f"{name} = {v:.4g} is above the physical peak {bound:.4g}")
    return out


def profile_problems(table) -> list[str]:
    """Problems with every value of a ProfileTable (its points, transfers and recorded peaks)."""
    lim = physical_limits(table.machine)
    out = peak_problems(table.info.get("peaks") or {}, table.machine)
    for e in table.entries.values():
        where = f"entry ({e.device}, {e.op}, {e.dtype}, {e.shape})"
        flops_cap = lim.get(f"cpu.flops.{e.dtype}", lim["cpu.flops.fp32"]) if e.device == "cpu" else lim["gpu.flops"]
        bytes_cap = lim[f"{e.device}.op_bytes_per_s"] if e.device in ("cpu", "gpu") else None
        for p in e.points:
            out += _point_problems(p, f"{where} at x={p.x:g}", flops_cap, bytes_cap)
    for name, pts in table.transfers.items():
        for p in pts:
            out += _point_problems(p, f"transfer {name} at {p.x:g} bytes", None, lim["link"], p.x)
    return out


def _point_problems(p, where: str, flops_cap, bytes_cap, moved_bytes=None) -> list[str]:
    out = []
    for attr in ("x", "seconds"):
        v = getattr(p, attr)
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            out.append(f"{where}: {attr} = {v!r} (must be positive)")
    for attr in ("spread_s", "flops", "bytes"):
        v = getattr(p, attr)
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            out.append(f"{where}: {attr} = {v!r} (must be >= 0)")
    if out:
        return out
    if flops_cap and p.flops / p.seconds > flops_cap:
        out.append(f"{where}: {p.flops / p.seconds:.4g} FLOP/s is above the physical peak {flops_cap:.4g}")
    nbytes = p.bytes if moved_bytes is None else moved_bytes
    if bytes_cap and nbytes / p.seconds > bytes_cap:
        out.append(f"{where}: {nbytes / p.seconds:.4g} B/s is above the physical peak {bytes_cap:.4g}")
    return out


# -- machine identity ---------------------------------------------------------------------------

def current_machine() -> dict:
    """This machine's identity: CPU model, logical CPUs, physical memory, GPU models (NVIDIA
    driver's /proc entries; None when a GPU stack without them is present)."""
    return {"cpu_model": _cpu_model(), "cpu_count": os.cpu_count() or 0,
            "memory_bytes": _memory_bytes(), "gpus": _gpus()}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _gpus() -> list | None:
    root = Path("/proc/driver/nvidia/gpus")
    if root.is_dir():
        names = []
        for info in sorted(root.glob("*/information")):
            for line in info.read_text().splitlines():
                if line.startswith("Model:"):
                    names.append({"name": line.split(":", 1)[1].strip()})
        return names
    return None if Path("/dev/kfd").exists() else []


def machine_differences(recorded: dict, here: dict) -> list[str]:
    """What differs between the machine a profile was measured on and ``here``: CPU model,
    logical CPUs, memory (more than 5 %), GPU models and GPU memory."""
    out = []
    if recorded.get("cpu_model") and recorded["cpu_model"] != here.get("cpu_model"):
        out.append(f"CPU model: profile {recorded['cpu_model']!r}, this machine {here.get('cpu_model')!r}")
    if recorded.get("cpu_count") and recorded["cpu_count"] != here.get("cpu_count"):
        out.append(f"CPUs: profile {recorded['cpu_count']}, this machine {here.get('cpu_count')}")
    if _differ(recorded.get("memory_bytes"), here.get("memory_bytes")):
        out.append(f"memory: profile {format_bytes(recorded['memory_bytes'])}, "
                   f"this machine {format_bytes(here.get('memory_bytes') or 0)}")
    rec_gpus, here_gpus = recorded.get("gpus"), here.get("gpus")
    if rec_gpus is not None and here_gpus is not None:
        names = lambda gs: [g.get("name", "?").strip().lower() for g in gs]  # noqa: E731
        if names(rec_gpus) != names(here_gpus):
            show = lambda gs: ", ".join(g.get("name", "?") for g in gs) or "none"  # noqa: E731
            out.append(f"GPUs: profile [{show(rec_gpus)}], this machine [{show(here_gpus)}]")
        else:
            for i, (a, b) in enumerate(zip(rec_gpus, here_gpus)):
                if _differ(a.get("memory_bytes"), b.get("memory_bytes")):
                    out.append(f"GPU {i} memory: profile {format_bytes(a['memory_bytes'])}, "
                               f"this machine {format_bytes(b['memory_bytes'])}")
    return out


def _differ(a, b, rel: float = 0.05) -> bool:
    return bool(a) and bool(b) and abs(a - b) > rel * max(a, b)
