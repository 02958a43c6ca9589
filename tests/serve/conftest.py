"""Every emulated serving engine a test makes holds at most the GPU bytes its plan puts there:
the plan's GPU bytes with the plan's own KV cache replaced by the engine's GPU pool (the serving
plan sizes that pool into what the plan leaves free), plus ``emulation_allowance_bytes``. Packed
weights multiply activations in fp32 (see ``fp32_activations``)."""

from __future__ import annotations

import pytest

from tests.conftest import emulation_allowance_bytes
from tests.serve.fixtures import ENGINES


def planned_gpu_bytes(engine) -> float:
    """plan GPU bytes - the plan's GPU KV + the pool's GPU tier bytes + the emulation allowance."""
    plan = engine.model.plan
    return (plan.memory["gpu_bytes"] - plan.memory["breakdown"]["gpu"]["kv"] + engine.pool.nbytes("gpu")
            + emulation_allowance_bytes(plan))


@pytest.fixture(autouse=True)
def serving_peak_within_the_plan():
    yield
    for engine in list(ENGINES):
        if engine.model.devices.mode != "emulated":
            continue
        peak = engine.model.devices.peak_bytes()["gpu"]
        allowed = planned_gpu_bytes(engine)
        assert peak <= allowed, (f"emulated serving engine of {engine.model.plan.model.name}: measured GPU peak "
                                 f"{peak} B > the {allowed:.0f} B its plan and pool hold")


@pytest.fixture(autouse=True)
def fp32_activations(monkeypatch):
    """Quantised weights multiply x in fp32. The int8-activation decode kernel (on by default on
    a CPU with AVX-512 VNNI, ``runtime/kernels/linear.py``) takes a linear of at most 8 rows of x,
    so a request decoding alone (exec, 1 row) and batched with others (serve, one row per token
    of the step) would be multiplied by different kernels, whose outputs differ by the rounding
    of x; the tests hold serve's tokens equal to exec's alone on the same arithmetic."""
    monkeypatch.setenv("HETPLAN_INT8_DECODE", "0")
