"""One LP relaxation of the count MILP, read through its duals, bounds the relaxation at every
other layer count of the same kind of stage (``solvers/ilp/counts.py``). The oracle is the LP
itself, built and solved afresh at each count."""

import math

import pytest

from hetplan.diagnose import fits_at_all
from hetplan.pipeline.stages import device_problem
from hetplan.solvers.ilp import IlpOptions, count_bounds, solve
from hetplan.solvers.ilp.counts import LineBound
from hetplan.solvers.ilp.layers import LayerModel, layered
from hetplan.solvers.ilp.per_block import memory_unit
from hetplan.workload import Workload
from tests.conftest import tiny_node, tiny_spec

L = 12
SPEC = tiny_spec(n_layers=L)
WL = Workload(batch=4, prompt_len=256, gen_len=32, objective="latency", prefill_chunk=256)


def span(kind: str, n: int) -> tuple:
    """Layers [a, b) of an ``n``-layer stage holding the embedding (first), neither end
    (middle) or the head (last)."""
    return {"first": (0, n), "middle": (1, 1 + n), "last": (L - n, L)}[kind]


def lp(hw, wl, kind: str, m: int, config) -> float:
    """The oracle: the LP relaxation of ``config``'s count MILP at ``m`` layers, solved afresh."""
    p = device_problem(SPEC, hw, wl, *span(kind, m))
    return LayerModel(p, layered(p), config[0], config[1], memory_unit(p)).lp_bound_s(IlpOptions())


@pytest.mark.parametrize("gpu_mib", [3, 64])
@pytest.mark.parametrize("kind", ["first", "middle", "last"])
@pytest.mark.parametrize("n", [2, 6])
def test_one_lp_bounds_the_lp_at_every_other_layer_count(gpu_mib, kind, n):
    hw = tiny_node(gpu_mib / 1024)
    problem = device_problem(SPEC, hw, WL, *span(kind, n))
    assert fits_at_all(problem)
    bounds = count_bounds(problem)
    assert bounds
    for config, bound in bounds.items():
        assert bound.at(n) == lp(hw, WL, kind, n, config)   # the LP's own value at its count
        for m in range(2, 11):
            want = lp(hw, WL, kind, m, config)
            got = bound.at(m)
            assert -math.inf < got <= want * (1 + 1e-9), (config, m)
            assert got > 0
            if gpu_mib == 64:   # every layer resident at every count: the LP is a line, the bound exact
                assert got == pytest.approx(want, rel=1e-8), (config, m)   # less the rounding margin


def test_a_one_layer_lp_and_an_objective_weighting_by_the_problem_bound_their_own_count_alone():
    hw = tiny_node(3 / 1024)
    one = count_bounds(device_problem(SPEC, hw, WL, 0, 1))
    assert all(b.at(1) == b.value_s and b.at(2) == -math.inf for b in one.values())
    ttft = Workload(batch=4, prompt_len=256, gen_len=32, objective="ttft", prefill_chunk=256)
    alone = count_bounds(device_problem(SPEC, hw, ttft, 0, 4))
    assert all(b.at(4) == b.value_s and b.at(5) == -math.inf for b in alone.values())


def test_an_infeasible_configuration_bounds_its_count_at_inf_and_says_nothing_of_others():
    hw = tiny_node(3 / 1024, cpu_gib=6 / 1024)   # DRAM for about 10 layers: streaming slots do not fit
    bounds = count_bounds(device_problem(SPEC, hw, WL, 0, 9))
    infeasible = [b for b in bounds.values() if b.value_s == math.inf]
    assert infeasible, "no configuration is infeasible here: the case tests nothing"
    assert all(b.at(9) == math.inf and b.at(5) == -math.inf for b in infeasible)


@pytest.mark.parametrize("gpu_mib", [3, 64])
def test_the_count_milp_solved_with_known_lps_finds_what_it_finds_computing_them(gpu_mib):
    """``solve(lp_bounds=...)`` (the LPs its stage was refined with) skips building the models
    those LPs cut off, and decides exactly as without them."""
    problem = device_problem(SPEC, tiny_node(gpu_mib / 1024), WL, 0, 6)
    known = {c: b.value_s for c, b in count_bounds(problem).items()}
    alone, given = solve(problem), solve(problem, lp_bounds=known)
    assert given.decision == alone.decision
    assert (given.status, given.objective_s, given.bound_s) == (alone.status, alone.objective_s, alone.bound_s)


def test_the_envelope_kept_as_certificates_arrive_is_the_least_over_configurations_of_their_best():
    """``Envelope`` (what a kind of stage's refinements teach each of its lengths), asked between
    additions, against the max/min over every certificate added so far, recomputed."""
    from hetplan.solvers.ilp.counts import Envelope

    hw = tiny_node(3 / 1024)
    env, added = Envelope(), {}
    assert env.at(5) == -math.inf
    for n in (3, 8, 5):
        for config, bound in count_bounds(device_problem(SPEC, hw, WL, 0, n)).items():
            env.add(config, bound)
            added.setdefault(config, []).append(bound)
            for m in range(2, 11):
                want = min(max(b.at(m) for b in certs) for certs in added.values())
                assert env.at(m) == want, (n, config, m)
    from hetplan.solvers.ilp import count_lines

    problem = device_problem(SPEC, hw, WL, 0, 5)
    lines = count_lines(problem, {c: b.slope() for c, b in count_bounds(problem).items() if b.value_s < math.inf}, 10)
    env.add_lines(lines)   # a configuration with lines: the least of its KV modes' lines where higher
    for m in range(2, 11):
        want = min(max(max(b.at(m) for b in certs),
                       min((l.at_ms(m) / 1000 for c, l in lines.items() if c[:2] == config), default=-math.inf))
                   for config, certs in added.items())
        assert env.at(m) == want, m


def milp_ms(hw, kind: str, m: int, config) -> float:
    """The oracle: the count MILP of ``config`` (depth, slot, KV mode) at ``m`` layers, solved
    afresh to optimality (weighted ms; inf where nothing fits)."""
    from hetplan.solvers.ilp.per_block import _kv_copies

    p = device_problem(SPEC, hw, WL, *span(kind, m))
    model = LayerModel(p, layered(p), config[0], config[1], memory_unit(p), kv_copies=_kv_copies(config))
    status, info, walk, _ = model.solve(IlpOptions(max_nodes=100_000, mip_rel_gap=1e-12), None)
    return info.objective_function_value if walk is not None else math.inf


@pytest.mark.parametrize("gpu_mib", [3, 64])
@pytest.mark.parametrize("kind", ["first", "middle", "last"])
def test_one_milp_with_the_count_free_bounds_the_count_milp_at_every_count_by_a_line(gpu_mib, kind):
    """``count_lines`` from a stage of 6 layers, at the slope of each configuration's LP
    certificate: below the count MILP solved afresh at every count, on it where every layer is
    resident (the MILP a line) and at the count of each step's plan; its steps raise it above
    the line of one MILP where the MILP bends."""
    from hetplan.solvers.ilp import count_lines

    hw = tiny_node(gpu_mib / 1024)
    problem = device_problem(SPEC, hw, WL, *span(kind, 6))
    slopes = {c: b.slope() for c, b in count_bounds(problem).items() if b.value_s < math.inf}
    lines = count_lines(problem, slopes, 10)
    assert lines and {c[:2] for c in lines} == set(slopes)
    raised = 0
    for config, line in lines.items():
        first = LineBound(line.hi, line.slope, line.steps[:1])   # the line of one MILP, not raised
        for m in range(2, 11):
            want = milp_ms(hw, kind, m, config)
            assert first.at_ms(m) <= line.at_ms(m) <= want * (1 + 1e-9), (config, m)
            raised += line.at_ms(m) > first.at_ms(m) * (1 + 1e-6)
            if gpu_mib == 64:
                assert line.at_ms(m) == pytest.approx(want, rel=1e-8), (config, m)
        for _, value, at in line.steps:   # each step meets the MILP at the count of its plan
            if value < math.inf:
                assert at is not None and line.at_ms(at) == pytest.approx(milp_ms(hw, kind, at, config), rel=1e-8)
    assert raised or gpu_mib == 64   # where the MILP bends (HBM full), the steps raise the line


@pytest.mark.parametrize("gpu_mib", [3, 64])
def test_a_count_milp_stopped_at_its_line_decides_as_one_solved_to_the_end(gpu_mib):
    """``solve(floors=...)``: each configuration's MILP stops at the first plan that reaches its
    line, a configuration whose line lies above the plan found is not solved; the plan is as good
    (to 1e-9) and proven so."""
    from hetplan.solvers.ilp import count_lines

    hw = tiny_node(gpu_mib / 1024)
    taught = device_problem(SPEC, hw, WL, 0, 4)
    lines = count_lines(taught, {c: b.slope() for c, b in count_bounds(taught).items() if b.value_s < math.inf}, 10)
    for n in (3, 5, 8):
        problem = device_problem(SPEC, hw, WL, 0, n)
        plain, floored = solve(problem), solve(problem, floors={c: l.at_ms(n) for c, l in lines.items()})
        assert floored.status == "optimal"
        assert floored.objective_s == pytest.approx(plain.objective_s, rel=1e-9)
        assert floored.bound_s <= floored.objective_s and floored.mip_gap <= 1e-9


@pytest.mark.parametrize("gpu_mib", [3, 64])
def test_lps_known_from_other_counts_spare_the_configurations_that_cannot_be_the_least(gpu_mib):
    """``count_bounds(known=...)`` with what two other counts' certificates teach each
    configuration: the least over configurations is the least of every LP solved afresh, a
    configuration not solved says only its known bound, at its own count, and (on the small GPU,
    where the configurations' LPs lie apart) some are not solved."""
    from hetplan.solvers.ilp.counts import Envelope

    hw = tiny_node(gpu_mib / 1024)
    env = Envelope()
    for n in (3, 9):
        for config, bound in count_bounds(device_problem(SPEC, hw, WL, 0, n)).items():
            env.add(config, bound)
    problem = device_problem(SPEC, hw, WL, 0, 6)
    full = count_bounds(problem)
    known = {c: env.config_at(c, 6) for c in env.certs}
    got = count_bounds(problem, known=known)
    assert min(b.value_s for b in got.values()) == min(b.value_s for b in full.values())
    spared = [c for c in got if not got[c].solved]
    assert spared or gpu_mib == 64, "every configuration was solved: the case tests nothing"
    for c in spared:
        assert got[c].value_s == known[c] <= full[c].value_s * (1 + 1e-9)
        assert got[c].at(5) == -math.inf
