"""The plan's devices on this machine: a CUDA GPU, an emulated one, or the CPU alone.

``Devices`` answers where a tier's tensors go (``gpu``: ``cuda:0``, or a CPU device standing in
for it; ``cpu``: host memory, pinned when a real GPU copies it asynchronously), which CUDA stream
serves each copy/compute resource, and how many bytes each tier holds. The emulated GPU has a
hard budget: every tensor the runtime places on it is counted, and one byte over raises a
HetplanError naming the bytes. Also the free-memory check a run makes before loading anything.

Knows nothing about models or schedules.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from hetplan.errors import HetplanError
from hetplan.units import format_bytes

CUDA_LANES = ("gpu", "h2d", "d2h", "h2d_act", "d2h_act")
"""Resources served by a CUDA stream on a real GPU (the ``cpu`` resource is a host thread)."""


class Ledger:
    """Bytes a tier holds now and at most, against an optional hard budget."""

    def __init__(self, tier: str, budget_bytes: float | None, emulated: bool = False):
        self.tier, self.budget_bytes, self.emulated = tier, budget_bytes, emulated
        self.used_bytes = 0
        self.peak_bytes = 0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, what: str) -> None:
        with self._lock:
            if self.budget_bytes is not None and self.used_bytes + nbytes > self.budget_bytes:
                name = "emulated GPU" if self.emulated else self.tier.upper()
                raise HetplanError(
                    f"{name} memory budget exceeded: {what} needs {format_bytes(nbytes)} ({nbytes} B) "
                    f"with {format_bytes(self.used_bytes)} ({self.used_bytes} B) of "
                    f"{format_bytes(self.budget_bytes)} ({int(self.budget_bytes)} B) already in use; the "
                    f"plan does not fit the budget it was compiled for: recompile it")
            self.used_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.used_bytes -= nbytes


class Devices:
    """Where tiers live and which queue serves each resource.

    ``mode``: ``cuda`` (a real GPU), ``emulated`` (the gpu resource is the CPU with its own queue
    and ``gpu_budget_bytes`` enforced) or ``cpu`` (the plan uses the CPU alone)."""

    def __init__(self, mode: str, gpu_budget_bytes: float | None = None):
        if mode not in ("cuda", "emulated", "cpu"):
            raise ValueError(mode)
        self.mode = mode
        self.cpu = torch.device("cpu")
        self.gpu = torch.device("cuda", torch.cuda.current_device()) if mode == "cuda" else \
            (self.cpu if mode == "emulated" else None)
        self.ledgers = {"gpu": Ledger("gpu", gpu_budget_bytes if mode == "emulated" else None,
                                      emulated=mode == "emulated"),
                        "cpu": Ledger("cpu", None)}
        self.streams = {}
        if mode == "cuda":
            # Activation copies are small and on the critical path: the highest priority
            # (priority_range() is (least, greatest)).
            torch.cuda.reset_peak_memory_stats(self.gpu)
            high = torch.cuda.Stream.priority_range()[1]
            self.streams = {"gpu": torch.cuda.Stream(), "h2d": torch.cuda.Stream(), "d2h": torch.cuda.Stream(),
                            "h2d_act": torch.cuda.Stream(priority=high),
                            "d2h_act": torch.cuda.Stream(priority=high)}

    @property
    def cuda(self) -> bool:
        return self.mode == "cuda"

    def device(self, tier: str) -> torch.device:
        return self.gpu if tier == "gpu" else self.cpu

    def stream(self, resource: str):
        """The CUDA stream serving ``resource``, or None for a host-thread resource."""
        return self.streams.get(resource)

    def empty(self, tier: str, shape: tuple, dtype: torch.dtype, what: str, pinned: bool = False,
              charged_bytes: int | None = None) -> torch.Tensor:
        """A counted allocation in ``tier`` (pinned host memory when ``pinned`` and a GPU copies it).
        ``charged_bytes``: what the tier's ledger counts, when not the tensor's own size (a buffer
        the emulated GPU holds in fp32 but a CUDA GPU in bf16)."""
        if charged_bytes is None:
            charged_bytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        self.ledgers[tier].reserve(charged_bytes, what)
        if tier == "cpu" and pinned and self.cuda:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        return torch.empty(shape, dtype=dtype, device=self.device(tier))

    def count(self, tier: str, t: torch.Tensor, what: str) -> None:
        """Count a tensor placed in ``tier`` without allocating (e.g. a memory-mapped view)."""
        self.ledgers[tier].reserve(t.numel() * t.element_size(), what)

    def to_tier(self, t: torch.Tensor, tier: str) -> torch.Tensor:
        """A copy of ``t`` in ``tier``, in a storage of its own; on CUDA issued on the current
        stream without blocking the host (through pinned memory on the way up)."""
        if not self.cuda:
            return t.clone(memory_format=torch.contiguous_format)
        if tier == "gpu":
            if t.device.type == "cpu" and not t.is_pinned():
                t = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
            return t.to(self.gpu, non_blocking=True)
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out

    def peak_bytes(self) -> dict:
        """Peak bytes per tier: the CUDA allocator's peak on a real GPU, else the ledger's."""
        gpu = torch.cuda.max_memory_allocated(self.gpu) if self.cuda else self.ledgers["gpu"].peak_bytes
        return {"gpu": int(gpu), "cpu": int(self.ledgers["cpu"].peak_bytes)}

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.gpu)


def _numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else physical memory."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_free_memory(plan_memory: dict, mode: str, free_gpu_bytes: int | None, free_cpu_bytes: int) -> None:
    """Refuse a run whose plan needs more than is free now: GPU bytes against the GPU's free
    memory (a real GPU), CPU bytes (plus the emulated GPU's, which lives in host memory too)
    against available host memory."""
    gpu_need, cpu_need = plan_memory["gpu_bytes"], plan_memory["cpu_bytes"]
    if mode == "cuda" and gpu_need > free_gpu_bytes:
        raise HetplanError(f"the plan needs {format_bytes(gpu_need)} of GPU memory but only "
                           f"{format_bytes(free_gpu_bytes)} is free now; free the GPU or recompile with "
                           f"--gpu-mem {format_bytes(free_gpu_bytes)}")
    host_need = cpu_need + (gpu_need if mode == "emulated" else 0)
    if host_need > free_cpu_bytes:
        what = "CPU memory" + (" (CPU tier + emulated GPU)" if mode == "emulated" else "")
        raise HetplanError(f"the plan needs {format_bytes(host_need)} of {what} but only "
                           f"{format_bytes(free_cpu_bytes)} is available now; close other programs or "
                           f"recompile with --cpu-mem {format_bytes(free_cpu_bytes)}")
