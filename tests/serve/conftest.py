"""Every emulated serving engine a test makes holds at most the GPU bytes its plan puts there:
the plan's GPU bytes with the plan's own KV cache replaced by the engine's GPU pool (the serving
plan sizes that pool into what the plan leaves free), plus ``emulation_allowance_bytes``."""

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
