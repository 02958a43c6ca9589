"""Shared tiny fixtures: model specs and machines built in code.

``tiny_spec(**overrides)`` is a llama-shaped ModelSpec small enough to plan in milliseconds;
``tiny_node(gpu_gib, cpu_gib, **overrides)`` a machine whose memory budgets are exactly the
given sizes (no reserves), or a CPU-only one with ``gpu_gib=None``. Tests import them with
``from tests.conftest import tiny_spec, tiny_node``.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

from hetplan.hardware import DeviceSpec, HardwareSpec

# Logits are held to 1e-4 of transformers with x multiplied in fp32: the int8-activation paths
# of the native kernel (on by default: prefill where AVX-512 VNNI is, decode also with AVX2) have their own bound, tested with
# these switches set to 1 in tests/exec/test_int8_kernels.py. Set for the whole run (module
# fixtures and CLI subprocesses included); a test that sets them itself wins.
os.environ.setdefault("HETPLAN_INT8_PREFILL", "0")
os.environ.setdefault("HETPLAN_INT8_DECODE", "0")

TINY_EFFICIENCY = {"gpu_mem": 0.85, "gpu_flops": 0.7, "cpu_mem": 0.7, "cpu_flops": 0.5, "link": 0.9}
TINY_LATENCY_S = {"gpu_task": 20e-6, "cpu_task": 20e-6, "link_task": 10e-6}
"""The tiny node's constants, fixed here (not the calibrated defaults, which a refit moves): the
hand-derived cost formulas of the tests are worked out with these."""
from hetplan.model import ModelSpec

GIB = 1 << 30


def tiny_spec(**overrides) -> ModelSpec:
    """A 2-layer llama-style model (hidden 256, GQA 4:2, vocab 1000, fp16); any field can be
    overridden, e.g. ``tiny_spec(n_layers=1, hidden=4096, weight_dtype="q4_0")``."""
    fields = dict(name="tiny", arch="llama", n_layers=2, hidden=256, intermediate=512, n_heads=4,
                  n_kv_heads=2, head_dim=64, vocab=1000, max_positions=4096, weight_dtype="fp16",
                  kv_dtype="fp16")
    fields.update(overrides)
    return ModelSpec(**fields)


def tiny_node(gpu_gib: float | None = 4.0, cpu_gib: float = 16.0, **overrides) -> HardwareSpec:
    """A desktop-like machine (GPU 500 GB/s and 50 TFLOPS fp16; CPU 50 GB/s and 1 TFLOPS;
    16 GB/s links) whose usable memory is exactly ``gpu_gib`` / ``cpu_gib`` GiB.
    ``gpu_gib=None`` gives a node without a GPU. Other HardwareSpec fields via ``overrides``."""
    gpus = () if gpu_gib is None else (
        DeviceSpec(name="tiny-gpu", memory_bytes=int(gpu_gib * GIB), mem_bytes_per_s=500e9,
                   flops_per_s={"fp16": 50e12, "bf16": 50e12, "fp32": 10e12}),)
    cpu = DeviceSpec(name="tiny-cpu", memory_bytes=int(cpu_gib * GIB), mem_bytes_per_s=50e9,
                     flops_per_s={"fp32": 1e12, "bf16": 1e12}, cores=8)
    hw = HardwareSpec(name="tiny-node", gpus=gpus, cpu=cpu, h2d_bytes_per_s=16e9, d2h_bytes_per_s=16e9,
                      gpu_reserve_bytes=0, cpu_reserve_bytes=0, efficiency=dict(TINY_EFFICIENCY),
                      latency_s=dict(TINY_LATENCY_S))
    return dataclasses.replace(hw, **overrides)


MILP_REPLAY_REL_TOL = 0.10
"""How far the fluid replay of an ILP plan may exceed the MILP's objective (relative). The MILP
times every task at its exclusive rate and bounds bus sharing by per-phase totals and by the
window of each weight load (``solvers/ilp/constraints.add_bus_bounds``, ``add_bus_windows``);
the replay also slows overlaps those leave out: a prompt-KV copy to DRAM beside a weight load
out of DRAM, activation copies, and tasks that each use part of a bus but together exceed it.
Measured: at most 2.3e-7 on the golden scenarios, 8.2% over 160 random small cases (the worst a
DRAM of 21 GB/s effective under a 14 GB/s link with both copy directions busy)."""


def emulation_allowance_bytes(plan) -> float:
    """What an emulated run may hold beyond the plan's GPU bytes: with quantised weights it
    computes in fp32 where the plan counts 16-bit activations, i.e. one more GPU workspace less
    its dequantisation buffer (which the plan reserves, and the emulated ledger charges, at its
    planned size); nothing otherwise."""
    from hetplan.dtypes import DEQUANT_BYTES, QUANTISED
    from hetplan.graph import dequant_buffer_elems, workspace_bytes
    spec = plan.model
    if spec.weight_dtype not in QUANTISED:
        return 0.0
    return workspace_bytes(spec, plan.workload, "gpu") - dequant_buffer_elems(spec) * DEQUANT_BYTES["gpu"]


@pytest.fixture(autouse=True)
def emulated_peak_within_the_plan(monkeypatch):
    """Every emulated run any test makes (``hetplan.runtime.session.run_plan``) measures a GPU peak
    at most the plan's GPU bytes (plus ``emulation_allowance_bytes``): plan peak >= measured peak."""
    session = sys.modules.get("hetplan.runtime.session")
    if session is None:  # no test module of this session runs plans
        yield
        return
    plans = []
    choose_mode, result = session.choose_mode, session.RunResult

    def remember(plan, emulate):
        plans.append(plan)
        return choose_mode(plan, emulate)

    def checked(**fields):
        out = result(**fields)
        if out.mode == "emulated" and plans:
            plan = plans[-1]
            allowed = plan.memory["gpu_bytes"] + emulation_allowance_bytes(plan)
            assert out.peak_bytes["gpu"] <= allowed, (
                f"emulated run of {plan.model.name}: measured GPU peak {out.peak_bytes['gpu']} B > "
                f"the plan's {plan.memory['gpu_bytes']:.0f} B (+ {allowed - plan.memory['gpu_bytes']:.0f} B allowed)")
        return out

    monkeypatch.setattr(session, "choose_mode", remember)
    monkeypatch.setattr(session, "RunResult", checked)
    yield
