"""Host weights and caches of a few MiB and more sit in memory advised for transparent huge
pages, starting on a 2 MiB boundary, unless ``HETPLAN_HUGE_PAGES=0``; the advice is read back
from the kernel's own record of the mapping (``VmFlags: hg`` in ``/proc/self/smaps``)."""

from __future__ import annotations

import sys

import pytest
import torch

from hetplan.runtime import devices as devices_module
from hetplan.runtime.devices import HUGE_MIN_BYTES, HUGE_PAGE_BYTES, Devices, host_empty

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")


def vm_flags(address: int) -> set:
    """The kernel's flags of the mapping holding ``address``."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_host_buffer_is_aligned_advised_and_usable():
    n = 3 * HUGE_PAGE_BYTES + 12345
    t = host_empty(n)
    assert t.numel() == n and t.dtype == torch.uint8
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    assert "hg" in vm_flags(t.data_ptr())
    t.fill_(7)
    assert int(t[-1]) == 7 and int(t.sum()) == 7 * n


def test_large_cpu_allocations_use_huge_pages_and_the_switch_turns_them_off(monkeypatch):
    devices = Devices("cpu")
    big = devices.empty("cpu", (HUGE_MIN_BYTES // 4,), torch.float32, "a weight")
    assert big.data_ptr() % HUGE_PAGE_BYTES == 0 and "hg" in vm_flags(big.data_ptr())
    big.copy_(torch.arange(big.numel(), dtype=torch.float32))
    assert float(big[-1]) == big.numel() - 1
    small = devices.empty("cpu", (1024,), torch.float32, "a small cache")
    assert "hg" not in vm_flags(small.data_ptr())
    monkeypatch.setenv("HETPLAN_HUGE_PAGES", "0")
    # torch's own allocator may advise huge pages too (THP_MEM_ALLOC_ENABLE, which the CLI sets
    # and torch reads once per process), so the switch is seen in which allocator was used
    made = []
    monkeypatch.setattr(devices_module, "host_empty", lambda n: made.append(n) or host_empty(n))
    plain = devices.empty("cpu", (HUGE_MIN_BYTES // 4,), torch.float32, "a weight")
    assert made == [] and plain.numel() == HUGE_MIN_BYTES // 4
    monkeypatch.delenv("HETPLAN_HUGE_PAGES")
    devices.empty("cpu", (HUGE_MIN_BYTES // 4,), torch.float32, "a weight")
    assert made == [HUGE_MIN_BYTES]
    assert devices.ledgers["cpu"].used_bytes == 3 * HUGE_MIN_BYTES + 4096


def test_only_whole_huge_pages_are_advised_so_the_tail_adds_nothing_resident():
    n = 2 * HUGE_PAGE_BYTES + 4096
    t = host_empty(n)
    assert "hg" in vm_flags(t.data_ptr()) and "hg" in vm_flags(t.data_ptr() + 2 * HUGE_PAGE_BYTES - 1)
    assert "hg" not in vm_flags(t.data_ptr() + 2 * HUGE_PAGE_BYTES)


def test_the_profiler_measures_weights_in_memory_placed_as_a_run_places_them():
    from hetplan.runtime.profiler import kernels
    w = kernels._rand((HUGE_MIN_BYTES // 4,), torch.float32, "cpu")
    copy = kernels._placed_copy(w)
    for t in (w, copy):
        assert t.data_ptr() % HUGE_PAGE_BYTES == 0 and "hg" in vm_flags(t.data_ptr())
    assert torch.equal(copy, w) and copy.data_ptr() != w.data_ptr()
