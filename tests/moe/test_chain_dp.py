"""The chain DP (``solvers/ilp/chain/``) decides MoE placements exactly.

On tiny MoE models whose layers route differently (so the count MILP does not apply and every
configuration goes to the per-block formulation), the DP's objective is the per-block MILP's
solved to a 1e-9 gap, over budgets from tight to loose, both staging depths, the latency,
throughput (one batch of the search) and tpot objectives, with and without streamed cold
experts, and with a CPU that cannot hold every weight. On a one-layer model the DP's plan is
the best of an exhaustive enumeration replayed by the independent simulator. The DP's value is
the schedule builder's timeline of its plan, and the compile time it reports counts it.
"""

import dataclasses
import math
import time

import pytest
from tests.conftest import tiny_node, tiny_spec
from tests.solver_model import with_copies_held_back

from hetplan.compiler import CompileRequest, decide
from hetplan.evaluate import fits, make_plan, objective_s, predictions
from hetplan.plan.simulate import check_plan
from hetplan.problem import build_problem
from hetplan.routing import RoutingStats, routing_fingerprint
from hetplan.schedule import build_schedule
from hetplan.solvers.ilp import IlpOptions, solve
from hetplan.solvers.ilp.layers import layered
from hetplan.workload import Workload

SPEC = tiny_spec(arch="mixtral", n_layers=3, hidden=1024, n_heads=8, n_kv_heads=4, head_dim=128, vocab=8000,
                 intermediate=2048, n_experts=4, experts_per_token=2, moe_intermediate=2048)
PROFILE = {0: (0.9, 0.6, 0.3, 0.2), 1: (0.25, 0.5, 0.5, 0.75), 2: (0.1, 0.95, 0.15, 0.8)}
"""Skewed and different per layer (each sums to top-k = 2): the layers' split tables differ."""
ROUTING = RoutingStats(routing_fingerprint(SPEC), PROFILE)
WORKLOADS = {"latency": Workload(batch=1, prompt_len=256, gen_len=64),
             "throughput": Workload(batch=8, prompt_len=512, gen_len=32, objective="throughput"),
             "tpot": Workload(batch=1, prompt_len=256, gen_len=64, objective="tpot")}
SHARES = {"tight": 0.15, "medium": 0.4, "loose": 1.5}
"""GPU budget = workspace + this share of all weights and KV."""
EXACT = dict(mip_rel_gap=1e-9)
MILP = dict(chain_dp=False, count_layers=False, mip_rel_gap=1e-9, max_nodes=10 ** 6)


def problem(workload: str, share: float, cpu_gib: float = 64):
    wl = WORKLOADS[workload]
    roomy = build_problem(SPEC, tiny_node(64, 64), wl, routing=ROUTING)
    total = sum(b.weight_bytes + b.kv_bytes for b in roomy.blocks)
    hw = tiny_node(1, cpu_gib).with_budgets(gpu_mem=math.ceil(roomy.gpu_workspace_bytes + share * total))
    return with_copies_held_back(build_problem(SPEC, hw, wl, routing=ROUTING))


def test_the_layers_differ_so_the_per_block_formulation_decides():
    assert layered(problem("latency", 0.4)) is None


@pytest.mark.parametrize("depths", [(2, 1), (1,)], ids=["depths-2-1", "depth-1"])
@pytest.mark.parametrize("stream", [False, True], ids=["cold-on-cpu", "stream-cold"])
@pytest.mark.parametrize("share", list(SHARES))
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_chain_dp_matches_the_per_block_milp_solved_to_a_tiny_gap(workload, share, stream, depths):
    pr = problem(workload, SHARES[share])
    dp = solve(pr, IlpOptions(stream_cold=stream, depths=depths, **EXACT))
    milp = solve(pr, IlpOptions(stream_cold=stream, depths=depths, **MILP))
    assert milp.status == "optimal" and dp.status == "optimal"
    assert "chain-dp" in dp.formulation and milp.formulation == "milp"
    assert dp.objective_s == pytest.approx(milp.objective_s, rel=1e-7)
    assert dp.bound_s <= dp.objective_s * (1 + 1e-12)


@pytest.mark.parametrize("workload", ["latency", "throughput"])
def test_chain_dp_matches_the_milp_when_the_cpu_cannot_hold_every_weight(workload):
    """The CPU row binds: the GPU must take some weights (the DP's lower memory limit)."""
    roomy = problem(workload, 1.5)
    weights = sum(b.weight_bytes + b.kv_bytes for b in roomy.blocks)
    cpu = (roomy.cpu_workspace_bytes + 0.6 * weights) / (1 << 30)
    pr = problem(workload, 1.5, cpu_gib=cpu)
    assert pr.cpu_budget_bytes - pr.cpu_workspace_bytes < weights
    dp = solve(pr, IlpOptions(**EXACT))
    milp = solve(pr, IlpOptions(**MILP))
    assert "chain-dp" in dp.formulation
    assert dp.objective_s == pytest.approx(milp.objective_s, rel=1e-7)
    gpu_weights = sum(b.weight_bytes for b in pr.blocks if dp.decision.weights[b.name] == "gpu")
    assert gpu_weights > 0


@pytest.mark.parametrize("share", list(SHARES))
def test_chain_dp_value_is_the_timeline_the_schedule_builder_replays(share):
    """At exclusive bandwidths (no bus shared) the schedule builder times the plan's tasks
    independently of the solver; where the DP decided, that timeline is its objective (or later
    only by what the MILP's bus rows bound)."""
    pr = problem("latency", SHARES[share])
    res = solve(pr, IlpOptions(**EXACT))
    replay = objective_s(pr, predictions(pr, build_schedule(pr, res.decision, shared_buses=False)))
    assert replay == pytest.approx(res.objective_s, rel=1e-9)
    plan = make_plan(pr, res.decision, {"strategy": "ilp"})
    assert fits(plan)
    check_plan(plan)


def test_a_tighter_budget_never_gives_a_faster_plan():
    values = [solve(problem("latency", SHARES[s]), IlpOptions(**EXACT)).objective_s for s in ("loose", "medium", "tight")]
    assert values[0] <= values[1] <= values[2] and values[0] < values[2]


# -- brute force on a one-layer model (streamed cold experts send it to the per-block formulation) --

@pytest.mark.parametrize("objective", ["latency", "tpot"])
@pytest.mark.parametrize("share", [0.25, 0.45, 0.65])
def test_chain_dp_is_the_best_enumerated_decision(share, objective):
    from tests.moe.test_expert_milp import SPEC as ONE_LAYER, WORKLOADS as WL, enumerated

    roomy, rows = enumerated("skewed", "chat")
    total = sum(b.weight_bytes + b.kv_bytes for b in roomy.blocks)
    gpu_budget = math.ceil(roomy.gpu_workspace_bytes + share * total)
    hw = tiny_node(1, 64).with_budgets(gpu_mem=gpu_budget)
    wl = dataclasses.replace(WL["chat"], objective=objective)
    value = (lambda r: r[1] + wl.gen_len * r[2]) if objective == "latency" else (lambda r: r[2])
    best = min((r for r in rows if r[3] <= gpu_budget and r[4] <= hw.cpu_budget_bytes()), key=value)

    pr = with_copies_held_back(build_problem(ONE_LAYER, hw, wl, routing=roomy.routing))
    res = solve(pr, IlpOptions(stream_cold=True, **EXACT))
    assert "chain-dp" in res.formulation
    dec, info, _ = decide(pr, "ilp", None, CompileRequest(model="tiny-moe", hw="tiny", stream_cold_experts=True,
                                                           objective=objective, mip_gap=1e-9))
    plan = make_plan(pr, dec, info)
    assert fits(plan)
    check_plan(plan)
    got = value((None, plan.predicted["ttft_s"], plan.predicted["tpot_s"]))
    assert got >= value(best) * (1 - 1e-6), "better than every decision that fits: the plan cannot be valid"
    assert got <= value(best) * (1 + 1e-6), f"{got:.9g} s > enumerated optimum {value(best):.9g} s"


def test_the_compile_time_counts_the_chain_dp(monkeypatch, tmp_path):
    """Building each configuration's option tables is slowed by 0.1 s: the reported wall time
    and the solver's time both count it."""
    from hetplan.compiler import compile_plan
    from hetplan.routing import write_routing
    from hetplan.routing_gen import skewed_profile
    from hetplan.presets.models import model_preset
    from hetplan.solvers.ilp import per_block

    built = []

    class SlowChain(per_block.Chain):
        def __init__(self, *args, **kwargs):
            time.sleep(0.1)
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(per_block, "Chain", SlowChain)
    path = tmp_path / "routing.json"
    write_routing(path, skewed_profile(model_preset("mixtral-8x7b"), 1.0, 0))
    plan, took = compile_plan(CompileRequest(model="mixtral-8x7b", hw="rtx4090-64g", weight_dtype="q4_k_m",
                                             routing=str(path)))
    assert plan.solver.get("formulation") == "chain-dp"
    assert built and took.solve_s >= 0.1 * len(built) and took.wall_s >= took.solve_s


# -- the fallback when the forward DP's fronts outgrow their limit --------------------------------

def _chains(pr):
    from hetplan.solvers.ilp.chain.dp import Chain
    from hetplan.solvers.ilp.objective import Weights
    from hetplan.solvers.ilp.per_block import configurations, slowest_stage_s

    weights = Weights(pr, slowest_stage_s(pr))
    return [Chain(pr, d, w, False, weights.w) for d, w in configurations(pr, (2, 1), True) if w], weights


@pytest.mark.parametrize("share", list(SHARES))
def test_plans_on_the_hbm_grid_fit_and_cost_what_their_timeline_says(share):
    """Every plan ``chain.cells`` hands out meets the GPU row with its true bytes, and its cost
    is the weighted phase makespans of its chain (``chain.plan.phase_ms``, the pair recursion
    evaluated block by block)."""
    from hetplan.solvers.ilp.chain.cells import cell_plans
    from hetplan.solvers.ilp.chain.plan import phase_ms

    pr = problem("latency", SHARES[share])
    chains, weights = _chains(pr)
    seen = 0
    for ch in chains:
        mults, _, dual = ch.lagrangian()
        for path, cost in cell_plans(ch, mults[0][0] if mults else 0.0):
            seen += 1
            assert ch.fits(sum(y[j] for y, j in zip(ch.y, path)))
            assert cost >= dual * (1 - 1e-9)
            t = phase_ms(ch, path)
            assert cost <= weights.weighted_ms(t) * (1 + 1e-9)  # phase_ms adds the rows the chain leaves out
    assert seen


@pytest.mark.parametrize("workload", ["latency", "throughput"])
@pytest.mark.parametrize("share", list(SHARES))
def test_a_state_limit_leaves_an_honest_plan(workload, share, monkeypatch):
    """With room for almost no states the search falls back to the grid's plans: what it
    reports is a plan no better than the optimum (the per-block MILP at a 1e-9 gap), a bound no
    higher, and "optimal" only within the gap tolerance."""
    from hetplan.solvers.ilp import per_block

    pr = problem(workload, SHARES[share])
    milp = solve(pr, IlpOptions(**MILP))
    for states in (5, 50):
        monkeypatch.setattr(per_block, "STATES_PER_NODE", states)
        dp = solve(pr, IlpOptions(max_nodes=1, **EXACT))
        assert dp.objective_s >= milp.objective_s * (1 - 1e-7)
        assert dp.bound_s <= milp.objective_s * (1 + 1e-7)
        if dp.status == "optimal":
            assert dp.objective_s == pytest.approx(milp.objective_s, rel=1e-7)
