"""Memory truth on a GPU, as far as a CPU can check it: pinned host buffers lock their bytes
rounded to a page (not to a power of two) and are counted as locked; a host without enough
lockable memory is refused with one line; the GPU budget becomes the allocator's fraction; the
CPU lane's threads leave a core to the lanes beside it."""

from __future__ import annotations

import pytest
import torch

from hetplan.errors import HetplanError
from hetplan.runtime.devices import (PAGE_BYTES, PinnedHost, check_pinned_memory, memory_fraction,
                                     page_round)
from hetplan.runtime.executor import home_lane_threads


class FakeDriver:
    """Records registrations; refuses once more than ``limit`` bytes are locked."""

    def __init__(self, limit: int = 1 << 40):
        self.limit, self.locked, self.calls = limit, {}, []

    def register(self, ptr: int, nbytes: int) -> int:
        self.calls.append((ptr, nbytes))
        if sum(self.locked.values()) + nbytes > self.limit:
            return 2   # cudaErrorMemoryAllocation
        self.locked[ptr] = nbytes
        return 0

    def unregister(self, ptr: int) -> None:
        del self.locked[ptr]


def test_page_round_is_whole_pages():
    assert page_round(1) == PAGE_BYTES
    assert page_round(PAGE_BYTES) == PAGE_BYTES
    assert page_round(PAGE_BYTES + 1) == 2 * PAGE_BYTES


def test_pinned_buffers_lock_their_bytes_rounded_to_a_page_and_are_page_aligned():
    drv = FakeDriver()
    host = PinnedHost(drv.register, drv.unregister)
    sizes = [3 * 2**20 + 5, 2**20, 17]        # a power-of-two allocator would lock 4 MiB + 1 MiB + 32 B ...
    bufs = [host.empty(n, f"buffer {i}") for i, n in enumerate(sizes)]
    assert [b.numel() for b in bufs] == sizes
    assert all(b.data_ptr() % PAGE_BYTES == 0 for b in bufs)
    assert [n for _, n in drv.calls] == [page_round(n) for n in sizes]
    assert host.pinned_bytes == sum(page_round(n) for n in sizes) == sum(drv.locked.values())
    bufs[0][-1] = 7                           # plain writable memory
    assert int(bufs[0][-1]) == 7
    host.close()
    assert drv.locked == {}


def test_a_view_cut_from_a_pinned_buffer_has_the_requested_dtype_and_shape():
    drv = FakeDriver()
    host = PinnedHost(drv.register, drv.unregister)
    t = host.empty(6 * 10 * 2, "kv").view(torch.bfloat16).view(6, 10)
    t.fill_(1.5)
    assert t.shape == (6, 10) and t.dtype == torch.bfloat16 and float(t.sum()) == 90.0


def test_host_without_enough_lockable_memory_is_refused_with_one_line():
    drv = FakeDriver(limit=3 * PAGE_BYTES)
    host = PinnedHost(drv.register, drv.unregister)
    host.empty(2 * PAGE_BYTES, "weights of mlp_0")
    with pytest.raises(HetplanError, match=r"cannot page-lock 8.00 KiB of host memory for weights of mlp_1 .*"
                                           r"not have enough free pinned memory") as e:
        host.empty(2 * PAGE_BYTES, "weights of mlp_1")
    assert "\n" not in str(e.value)
    assert host.pinned_bytes == 2 * PAGE_BYTES


def test_plan_pinning_more_than_is_available_is_refused_before_loading():
    check_pinned_memory(2**30, 2**31)
    with pytest.raises(HetplanError, match=r"pins 2.00 GiB of host memory .* only 1.00 GiB is available now: the machine "
                                           r"does not have enough free pinned memory"):
        check_pinned_memory(2 * 2**30, 2**30)


def test_gpu_budget_is_the_fraction_of_the_device_the_allocator_may_reserve():
    assert memory_fraction(20 * 2**30, 80 * 2**30) == 0.25
    assert memory_fraction(100 * 2**30, 80 * 2**30) == 1.0


@pytest.mark.parametrize("cores, lanes, home, want", [
    (8, ("cpu",), "cpu", 8),                           # an all-CPU phase keeps every core
    (8, ("cpu", "gpu", "h2d", "d2h_act"), "cpu", 7),   # the lanes beside it take about one core
    (2, ("gpu", "h2d"), "gpu", 1),
    (1, ("cpu", "gpu"), "cpu", 1),                     # never below one thread
])
def test_home_lane_threads_leave_a_core_to_the_lanes_beside_it(cores, lanes, home, want):
    assert home_lane_threads(cores, lanes, home) == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pinned_buffer_is_registered_and_copies_asynchronously():
    from hetplan.runtime.devices import Devices
    dev = Devices("cuda", gpu_budget_bytes=2**30)
    t = dev.empty("cpu", (1 << 20,), torch.float32, "test", pinned=True)
    assert t.is_pinned()
    assert dev.pinned_bytes == page_round(4 << 20)
    t.fill_(2.0)
    g = t.to(dev.gpu, non_blocking=True)
    torch.cuda.synchronize()
    assert float(g.sum()) == 2.0 * (1 << 20)
    dev.close()
