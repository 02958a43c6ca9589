"""``hetplan.pipeline.forked``: the items of a map shared with forked children, the answers as a loop's."""

import os

import pytest

from hetplan.errors import HetplanError
from hetplan.pipeline.forked import cpu_seconds, forked_map, jobs


def test_the_map_is_the_loop_in_order_with_children_doing_part_of_it():
    parent = os.getpid()
    got = forked_map(lambda x: (x * x, os.getpid() == parent), list(range(9)), 3)
    assert [v for v, _ in got] == [x * x for x in range(9)]
    assert not all(here for _, here in got)   # some items ran in a child
    assert [here for _, here in got][::3] == [True] * 3   # the first share ran here


def test_an_exception_in_a_child_is_raised_here():
    def fn(x):
        if x == 4:
            raise HetplanError(f"item {x} is bad")
        return x
    with pytest.raises(HetplanError, match="item 4 is bad"):
        forked_map(fn, list(range(6)), 2)


def test_a_child_that_dies_costs_only_time():
    parent = os.getpid()

    def fn(x):
        if os.getpid() != parent:
            os._exit(3)   # a child killed before it answers
        return x + 1
    assert forked_map(fn, [1, 2, 3, 4], 2) == [2, 3, 4, 5]


def test_one_job_runs_everything_here(monkeypatch):
    parent = os.getpid()
    monkeypatch.setenv("HETPLAN_JOBS", "1")
    assert jobs() == 1
    assert forked_map(lambda x: os.getpid() == parent, [0, 1, 2]) == [True] * 3


@pytest.mark.parametrize("value", ["0", "two", "-3"])
def test_a_bad_job_count_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("HETPLAN_JOBS", value)
    with pytest.raises(HetplanError, match=f"HETPLAN_JOBS='{value}'.*at least 1"):
        jobs()


def test_cpu_seconds_count_the_children():
    def spin(_):
        t0 = cpu_seconds()
        while cpu_seconds() - t0 < 0.2:
            pass
        return 0
    before = cpu_seconds()
    forked_map(spin, [0, 1], 2)
    assert cpu_seconds() - before >= 0.35   # this process's 0.2 s and the child's
