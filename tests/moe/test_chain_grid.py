"""The memory row rounded onto a grid (``solvers/ilp/chain/grid.py``) brackets the optimum.

On the tiny MoE model of ``test_chain_dp`` (layers routed differently, skewed), for every
configuration of tight, medium and loose budgets and the latency and throughput objectives: the
grid's bound is at most the per-block MILP's optimum of that configuration (solved to a 1e-9
gap), its plan meets the memory rows with its true bytes and costs no less than that optimum,
and on a fine grid the two meet it. With almost no states for the forward DP the search falls
back to the grid and still proves the per-block MILP's optimum.
"""

import pytest
from tests.moe.test_chain_dp import EXACT, MILP, SHARES, _chains, problem

from hetplan.solvers.ilp import IlpOptions, solve
from hetplan.solvers.ilp.chain.grid import grid
from hetplan.solvers.ilp.per_block import _Model


def _optimum_ms(pr, ch, weights):
    """The per-block MILP of the chain's configuration at a 1e-9 gap, weighted as the chain is."""
    res = _Model(pr, ch.depth, ch.slot, stream_cold=False).solve(IlpOptions(**MILP))
    return res, weights.cutoff_ms(res.objective_s) if res.decision is not None else float("inf")


@pytest.mark.parametrize("workload", ["latency", "throughput"])
@pytest.mark.parametrize("share", list(SHARES))
def test_grid_bound_and_plan_bracket_the_milp_optimum(workload, share):
    pr = problem(workload, SHARES[share])
    chains, weights = _chains(pr)
    binding = 0
    for ch in chains:
        found = grid(ch, 0.0, None, cells=(64, 4096))
        if found is None:
            assert sum(y.max() for y in ch.y) <= ch.upper or not ch.any_fits()
            continue
        milp, opt_ms = _optimum_ms(pr, ch, weights)
        assert milp.status == "optimal"
        assert found.bound_ms <= opt_ms * (1 + 1e-7)
        if found.plan is not None:
            path, cost = found.plan
            assert ch.fits(sum(y[j] for y, j in zip(ch.y, path)))
            assert cost == pytest.approx(ch.cost(path), rel=1e-12)
            assert cost >= opt_ms * (1 - 1e-7)
            assert found.cells == 4096 or found.bound_ms >= cost * (1 - 1e-9)
            binding += 1
    assert binding or share == "loose"  # a loose budget holds every block at its largest


@pytest.mark.parametrize("share", list(SHARES))
def test_a_coarse_grid_bound_is_no_higher_than_a_fine_one_needs(share):
    """Each grid size gives a valid bound: a coarse one is looser, never above the optimum."""
    pr = problem("latency", SHARES[share])
    chains, weights = _chains(pr)
    for ch in chains:
        coarse = grid(ch, -1.0, None, cells=(8,))
        if coarse is None:
            continue
        _, opt_ms = _optimum_ms(pr, ch, weights)
        assert coarse.bound_ms <= opt_ms * (1 + 1e-7)


@pytest.mark.parametrize("workload", ["latency", "throughput"])
@pytest.mark.parametrize("share", list(SHARES))
def test_the_grid_proves_the_optimum_when_the_fronts_outgrow_their_limit(workload, share, monkeypatch):
    from hetplan.solvers.ilp import per_block
    from hetplan.solvers.ilp.chain import dp as chain

    pr = problem(workload, SHARES[share])
    milp = solve(pr, IlpOptions(**MILP))
    monkeypatch.setattr(per_block, "STATES_PER_NODE", 3)
    monkeypatch.setattr(chain, "cell_plans", lambda *a, **k: [])  # only the grid can close the gap
    calls = []
    monkeypatch.setattr(chain, "grid", lambda *a, **k: calls.append(1) or grid(*a, **k))
    dp = solve(pr, IlpOptions(max_nodes=1, **EXACT))
    assert calls or share == "loose"
    assert dp.objective_s >= milp.objective_s * (1 - 1e-7)
    assert dp.bound_s <= milp.objective_s * (1 + 1e-7)
    assert dp.status == "optimal"
    assert dp.objective_s == pytest.approx(milp.objective_s, rel=1e-6)
