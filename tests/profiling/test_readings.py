"""The points a decode step of one sequence is priced with are timed at several moments and their
repeats pooled: one slow stretch of the machine moves them only when it covers most readings.
Timed on a clock the test advances itself (each call "takes" the seconds it is told to)."""

import pytest

from hetplan.cost import Work
from hetplan.runtime.profiler import measure
from hetplan.runtime.profiler.kernels import Kernel


class Clock:
    def __init__(self):
        self.now, self.cost = 1000.0, 0.0

    def __call__(self) -> float:
        return self.now

    def call(self) -> None:
        self.now += self.cost


def kernels(clock) -> list:
    work = Work(flops=1e6, bytes=1e6, op="mlp", tokens=1)
    setup = lambda cache: clock.call   # noqa: E731
    return [Kernel("cpu", "mlp", "fp32", "d64", 1, work, "cpu/m/mlp", setup),
            Kernel("cpu", "mlp", "fp32", "d64", 64, work, "cpu/m/mlp", setup)]


def first_reading(monkeypatch, budget_s: float):
    clock = Clock()
    monkeypatch.setattr(measure.time, "perf_counter", clock)
    budget = measure.Budget(budget_s, start=clock.now)
    entries, raw, overhead = {}, {}, {"cpu": 1e-5}
    clock.cost = 8e-3                                   # a slow stretch while every kernel is timed
    measure._run_kernels(kernels(clock), {("cpu", "fp32"): 1e11}, overhead, entries, budget, lambda _: None,
                         final=True, raw=raw)
    return clock, budget, entries, raw, overhead


def test_one_row_points_pool_the_repeats_of_every_reading(monkeypatch):
    clock, budget, entries, raw, overhead = first_reading(monkeypatch, 600.0)
    assert list(raw) == [("cpu", "mlp", "fp32", "d64", 1)]     # only the one-row point is kept
    clock.cost = 1e-3                                   # the machine is quick again
    readings = measure._time_again(kernels(clock), raw, overhead, entries, budget)
    assert readings == measure.READINGS == 3
    point = entries[("cpu", "mlp", "fp32", "d64")][1]
    assert point.seconds == pytest.approx(1e-3 + 1e-5)                # two quick readings of three: the median is quick
    assert point.repeats == len(raw[("cpu", "mlp", "fp32", "d64", 1)]) > 31
    assert entries[("cpu", "mlp", "fp32", "d64")][64].seconds == pytest.approx(8e-3 + 1e-5)   # timed once


def test_without_budget_left_the_first_reading_stands(monkeypatch):
    clock, budget, entries, raw, overhead = first_reading(monkeypatch, 600.0)
    clock.now = budget.start + 599.0                    # the budget is spent
    clock.cost = 1e-3
    assert measure._time_again(kernels(clock), raw, overhead, entries, budget) == 1
    assert entries[("cpu", "mlp", "fp32", "d64")][1].seconds == pytest.approx(8e-3 + 1e-5)
