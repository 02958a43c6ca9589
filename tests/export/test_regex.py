"""Layer-set regexes match exactly the layer numbers of the set: checked against integer
membership for every set of runs up to 130 (digit-count and decade boundaries included)."""

from __future__ import annotations

import re

import pytest

from hetplan.export.regex import layers_regex, runs

NUMBERS = [str(i) for i in range(1000)] + ["00", "01", "007", "-1", "1a", ""]


@pytest.mark.parametrize("lo", [0, 1, 5, 9, 10, 11, 19, 20, 37, 90, 99, 100, 101])
def test_a_range_matches_exactly_its_numbers(lo):
    for hi in range(lo, 131):
        pattern = re.compile(rf"^{layers_regex(range(lo, hi + 1))}$")
        assert {s for s in NUMBERS if pattern.match(s)} == {str(i) for i in range(lo, hi + 1)}, (lo, hi)


def test_scattered_layers_match_exactly_themselves():
    layers = {0, 2, 3, 4, 9, 10, 11, 19, 20, 55, 99, 100, 127}
    pattern = re.compile(rf"^{layers_regex(layers)}$")
    assert {s for s in NUMBERS if pattern.match(s)} == {str(i) for i in layers}


def test_runs_are_the_maximal_consecutive_stretches():
    assert runs([5, 1, 2, 3, 7, 8, 3]) == [(1, 3), (5, 5), (7, 8)]
