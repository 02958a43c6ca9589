"""The plan's devices on this machine: a CUDA GPU, an emulated one, or the CPU alone.

``Devices`` answers where a tier's tensors go (``gpu``: ``cuda:0``, or a CPU device standing in
for it; ``cpu``: host memory, pinned when a real GPU copies it asynchronously), which CUDA stream
serves each copy/compute resource, and how many bytes each tier holds. The GPU has a hard
budget: on the emulated one every tensor the runtime places is counted, and one byte over raises
a HetplanError naming the bytes; on a CUDA GPU the caching allocator is capped at the plan's
budget (``set_per_process_memory_fraction``) and peaks are read back as allocated and reserved.

Pinned host memory is plain anonymous memory page-locked where it lies (``PinnedHost``:
``cudaHostRegister``), never ``pin_memory=True``: torch's caching host allocator rounds each such
allocation up to a power of two (a 49 GiB plan would lock 73 GiB), while a registered buffer
locks its bytes rounded to a page, and those are the bytes counted. Activations crossing PCIe
go through pinned buffers made once per copy and value and reused every step (``to_tier``).
Also the free-memory checks a run makes before loading anything.

Knows nothing about models or schedules.
"""

from __future__ import annotations

import mmap
import threading
from pathlib import Path

import torch

from hetplan.env import switch
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


PAGE_BYTES = mmap.PAGESIZE
HUGE_PAGE_BYTES = 2 << 20
"""A transparent huge page (x86-64, arm64 with 4 KiB base pages)."""


def host_empty(nbytes: int) -> torch.Tensor:
    """A uint8 [nbytes] tensor over fresh anonymous memory whose whole 2 MiB pieces are backed by
    transparent huge pages where the kernel grants them (``MADV_HUGEPAGE`` on those pieces alone,
    before the first touch, the start aligned to 2 MiB; the tail keeps 4 KiB pages). Weights are streamed whole every decode step: in 4 KiB
    pages each page costs a TLB miss and restarts the hardware prefetcher, which on a 2-core
    EPYC took 10-15 % of a quantised GEMV's DRAM stream (bench/RESULTS.md). The mapping reserves
    up to 2 MiB more address space than asked; pages never touched are never resident. The
    tensor keeps the mapping alive."""
    size = page_round(max(1, nbytes)) + HUGE_PAGE_BYTES
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    skip = -flat.data_ptr() % HUGE_PAGE_BYTES
    whole = nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if hasattr(mmap, "MADV_HUGEPAGE") and whole:   # the whole 2 MiB pieces only: a huge page under
        buf.madvise(mmap.MADV_HUGEPAGE, skip, whole)  # the tail would be resident past the buffer's end
    return flat[skip:skip + nbytes]


HUGE_MIN_BYTES = 4 * HUGE_PAGE_BYTES
"""Host allocations from this size up are made by ``host_empty`` (smaller ones by torch's
allocator: a huge page cannot back less than 2 MiB)."""


def placed_empty(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor in memory of the kind the runtime places weights and caches in:
    on the host from ``HUGE_MIN_BYTES`` up, a huge-page mapping (``host_empty``; not with
    ``HETPLAN_HUGE_PAGES=0``); otherwise torch's allocator. The profiler measures kernels on it
    too, so that a profile prices the pages a run reads."""
    n = _numel(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type == "cpu" and n >= HUGE_MIN_BYTES and switch("HETPLAN_HUGE_PAGES", True):
        return host_empty(n).view(dtype).view(shape)
    return torch.empty(shape, dtype=dtype, device=device)


def page_round(nbytes: int) -> int:
    """Bytes a registration of ``nbytes`` locks: whole pages, ceil(nbytes / page) * page."""
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


class PinnedHost:
    """Page-locked host buffers made of plain anonymous memory (``mmap``, page-aligned), each
    registered with the GPU driver by ``register(ptr, nbytes) -> error code`` (0 = success) and
    released by ``unregister(ptr)``; ``pinned_bytes`` is what is locked: the sum of
    ``page_round`` over the buffers."""

    def __init__(self, register, unregister):
        self._register, self._unregister = register, unregister
        self._live = []      # (ptr, mmap) of every registered buffer
        self.pinned_bytes = 0

    def empty(self, nbytes: int, what: str) -> torch.Tensor:
        """A uint8 [nbytes] tensor over fresh page-locked memory."""
        size = page_round(max(1, nbytes))
        buf = mmap.mmap(-1, size)
        if hasattr(mmap, "MADV_HUGEPAGE"):   # streamed whole: see host_empty
            buf.madvise(mmap.MADV_HUGEPAGE)
        flat = torch.frombuffer(buf, dtype=torch.uint8)
        err = self._register(flat.data_ptr(), size)
        if err != 0:
            raise HetplanError(f"cannot page-lock {format_bytes(size)} of host memory for {what} (driver error "
                               f"{err}) with {format_bytes(self.pinned_bytes)} already locked: the machine does "
                               f"not have enough free pinned memory; close other programs or recompile with a "
                               f"smaller --cpu-mem")
        self._live.append((flat.data_ptr(), buf))
        self.pinned_bytes += size
        return flat[:nbytes]

    def close(self) -> None:
        """Unregister every buffer (the tensors stay valid as plain memory while referenced)."""
        for ptr, _ in self._live:
            self._unregister(ptr)
        self._live.clear()


def check_pinned_memory(need_bytes: int, available_bytes: int) -> None:
    """Refuse a run whose pinned host memory (streamed weights, KV caches the GPU copies into)
    is more than the host has available: locked pages cannot be swapped or reclaimed."""
    if need_bytes > available_bytes:
        raise HetplanError(f"the plan pins {format_bytes(need_bytes)} of host memory (streamed weights and KV "
                           f"copied by the GPU) but only {format_bytes(available_bytes)} is available now: the "
                           f"machine does not have enough free pinned memory; close other programs or recompile "
                           f"with --cpu-mem {format_bytes(available_bytes)}")


def memory_fraction(budget_bytes: float, total_bytes: int) -> float:
    """The fraction of the GPU the caching allocator may reserve: budget / total, at most 1."""
    return min(1.0, max(0.0, budget_bytes / total_bytes))


def _cuda_host_register():
    rt = torch.cuda.cudart()
    return (lambda ptr, n: int(rt.cudaHostRegister(ptr, n, 0)), lambda ptr: rt.cudaHostUnregister(ptr))


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
        self.pinned = PinnedHost(*_cuda_host_register()) if mode == "cuda" else None
        self._act_buffers = {}   # (key, dtype) -> pinned buffer for activations crossing PCIe
        self.act_pinned_bytes = 0
        if mode == "cuda":
            if gpu_budget_bytes is not None:
                total = torch.cuda.get_device_properties(self.gpu).total_memory
                torch.cuda.set_per_process_memory_fraction(memory_fraction(gpu_budget_bytes, total), self.gpu)
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
        n = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        self.ledgers[tier].reserve(n if charged_bytes is None else charged_bytes, what)
        if tier == "cpu" and pinned and self.cuda:
            return self.pinned.empty(n, what).view(dtype).view(shape)
        return placed_empty(shape, dtype, self.device(tier))

    @property
    def pinned_bytes(self) -> int:
        """Host bytes page-locked: registered buffers plus activation buffers (the latter made by
        torch's caching host allocator, counted rounded up to a power of two as it locks them)."""
        return (self.pinned.pinned_bytes if self.pinned else 0) + self.act_pinned_bytes

    def _act_buffer(self, key, t: torch.Tensor) -> torch.Tensor:
        """The pinned host buffer of activation copy ``key``, made on first use and reused by every
        later step (grown if a later value is larger), viewed as ``t``'s shape."""
        n = t.numel()
        buf = self._act_buffers.get((key, t.dtype))
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=t.dtype, pin_memory=True)
            self.act_pinned_bytes += _pow2(n * t.element_size())
            self._act_buffers[key, t.dtype] = buf
        return buf[:n].view(t.shape)

    def count(self, tier: str, t: torch.Tensor, what: str) -> None:
        """Count a tensor placed in ``tier`` without allocating (e.g. a memory-mapped view)."""
        self.ledgers[tier].reserve(t.numel() * t.element_size(), what)

    def to_tier(self, t: torch.Tensor, tier: str, key=None) -> torch.Tensor:
        """A copy of ``t`` in ``tier``, in a storage of its own; on CUDA issued on the current
        stream without blocking the host, through copy ``key``'s pinned buffer (reused every step:
        the executor synchronises between steps, and within one a key is written once)."""
        if not self.cuda:
            return t.clone(memory_format=torch.contiguous_format)
        if tier == "gpu":
            if t.device.type == "cpu" and not t.is_pinned():
                t = self._act_buffer(key, t).copy_(t)
            return t.to(self.gpu, non_blocking=True)
        out = self._act_buffer(key, t)
        out.copy_(t, non_blocking=True)
        return out

    def peak_bytes(self) -> dict:
        """Peak bytes per tier: on a real GPU the caching allocator's peak allocated bytes
        (``gpu``) and peak reserved bytes (``gpu_reserved``: what the process held from the
        driver), else the ledger's."""
        if self.cuda:
            return {"gpu": int(torch.cuda.max_memory_allocated(self.gpu)),
                    "gpu_reserved": int(torch.cuda.max_memory_reserved(self.gpu)),
                    "cpu": int(self.ledgers["cpu"].peak_bytes)}
        return {"gpu": int(self.ledgers["gpu"].peak_bytes), "cpu": int(self.ledgers["cpu"].peak_bytes)}

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.gpu)

    def close(self) -> None:
        """Unregister the pinned buffers (after the last copy: the caller synchronised)."""
        if self.pinned:
            self.pinned.close()


def _pow2(n: int) -> int:
    """The power of two torch's caching host allocator rounds an allocation of n bytes up to."""
    return 1 << max(0, (n - 1).bit_length())


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
                           f"--gpu-mem {_size_arg(free_gpu_bytes)}")
    host_need = cpu_need + (gpu_need if mode == "emulated" else 0)
    if host_need > free_cpu_bytes:
        what = "CPU memory" + (" (CPU tier + emulated GPU)" if mode == "emulated" else "")
        fix = (f"--gpu-mem and --cpu-mem that add up to at most {_size_arg(free_cpu_bytes)} (the emulated GPU "
               f"lives in host memory too)" if mode == "emulated" else f"--cpu-mem {_size_arg(free_cpu_bytes)}")
        raise HetplanError(f"the plan needs {format_bytes(host_need)} of {what} but only "
                           f"{format_bytes(free_cpu_bytes)} is available now; close other programs or "
                           f"recompile with {fix}")


def _size_arg(n: int) -> str:
    """``n`` bytes as a --gpu-mem/--cpu-mem value that is at most ``n`` (``22GiB``, ``512MiB``)."""
    return f"{n // 2**30}GiB" if n >= 2**30 else f"{max(1, n // 2**20)}MiB"
