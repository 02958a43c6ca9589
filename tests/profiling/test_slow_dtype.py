"""A dtype the CPU runs far slower than fp32 (bf16 GEMMs without native support) is written into
the profiled node at its measured rate, so plans price it as it runs, never at the fp32 rate."""

from __future__ import annotations

import pytest

from hetplan.cli.profile import node_dict
from hetplan.hardware import load_node
from hetplan.runtime.profiler import measure

FP32_RATE, SLOW_RATE = 50e9, 1e9   # 2 % of fp32: below measure.USABLE_FRACTION


@pytest.fixture
def slow_bf16(monkeypatch):
    rates = {"fp32": FP32_RATE, "bf16": SLOW_RATE, "fp16": SLOW_RATE}
    by_dtype = {dt: name for name, dt in measure.TORCH_DTYPES.items()}
    monkeypatch.setattr(measure, "_probe_rate", lambda dt, dev, sync, n, gemm: rates[by_dtype[dt]])
    monkeypatch.setattr(measure, "_read_s", lambda nbytes, dev, sync, share: nbytes / 20e9)
    # a GEMM of n^3 multiply-adds timed at the fp32 rate
    monkeypatch.setattr(measure, "time_call", lambda fn, sync, share, deadline=None:
                        measure.Timing(2 * 256 ** 3 / FP32_RATE, 0.0, 3))


def test_slow_dtype_is_recorded_at_its_measured_rate(slow_bf16):
    peaks, rates = {}, {}
    budget = measure.Budget(seconds=5.0)
    usable = measure._device_peaks("cpu", peaks, rates, budget, tick=lambda label: None)
    assert usable == ["fp32"]
    assert peaks["cpu.flops.bf16"] == SLOW_RATE and peaks["cpu.flops.fp16"] == SLOW_RATE
    assert any(s.startswith("cpu bf16 GEMMs") for s in budget.skipped)


def test_profiled_node_prices_bf16_at_the_slow_rate(slow_bf16, tmp_path):
    import yaml
    peaks, rates = {}, {}
    measure._device_peaks("cpu", peaks, rates, measure.Budget(seconds=5.0), tick=lambda label: None)
    machine = {"cpu_model": "test cpu", "cpu_count": 2, "memory_bytes": 8 * 2**30}
    (tmp_path / "node.yaml").write_text(yaml.safe_dump(node_dict(peaks, machine, "none.json") | {"profile": None}))
    cpu = load_node(str(tmp_path / "node.yaml")).cpu
    assert cpu.peak_flops("bf16") == pytest.approx(SLOW_RATE, rel=1e-3)
    assert cpu.peak_flops("fp32") > 10 * cpu.peak_flops("bf16")


def test_cpu_16bit_gemms_are_timed_through_the_runtimes_linear(monkeypatch):
    """On the CPU a 16-bit GEMM is timed as the runtime multiplies it (``linear``: upcast where the
    CPU has no 16-bit GEMMs), fp32 by torch's GEMM; so a CPU that upcasts is priced at the upcast
    rate, not at the emulated one."""
    import torch
    called = []

    def recording(x, w, bias=None):
        called.append(x.dtype)
        return torch.zeros(x.shape[0], w.shape[0], dtype=x.dtype)
    monkeypatch.setattr(measure, "linear", recording)
    monkeypatch.setattr(measure, "_read_s", lambda nbytes, dev, sync, share: nbytes / 20e9)
    monkeypatch.setattr(measure, "time_call", lambda fn, sync, share, deadline=None:
                        (fn(), measure.Timing(2 * 256 ** 3 / FP32_RATE, 0.0, 3))[1])
    usable = measure._device_peaks("cpu", {}, {}, measure.Budget(seconds=5.0), tick=lambda label: None)
    assert set(called) == {torch.bfloat16, torch.float16}
    assert "bf16" in usable
