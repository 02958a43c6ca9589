"""The count MILP (``solvers/ilp/layers.py``) of models with identical layers.

Oracles: the per-block MILP (``solvers/ilp``, an independent formulation with one variable set
per block, solved to a 1e-9 gap), the simulator's replay of the plan, and the schedule rule
for issuing loads restated here by hand.
"""

import dataclasses

import pytest
from tests.conftest import MILP_REPLAY_REL_TOL, tiny_node, tiny_spec
from tests.solver_model import with_copies_held_back

from hetplan.evaluate import fits, make_plan
from hetplan.plan import Decision
from hetplan.problem import build_problem
from hetplan.schedule import build_schedule
from hetplan.plan.simulate import check_plan
from hetplan.solvers import ilp
from hetplan.solvers.ilp.layers import LayerModel, layered
from hetplan.workload import Workload

SHAPE = dict(hidden=1024, intermediate=4096, n_heads=16, n_kv_heads=4, head_dim=64, vocab=8000)
WORKLOADS = {"short": Workload(batch=1, prompt_len=256, gen_len=64),
             "long": Workload(batch=8, prompt_len=1024, gen_len=8)}
LINK = dict(h2d_bytes_per_s=12e9, d2h_bytes_per_s=12e9)


def _problem(n_layers, gpu_fraction, workload, objective="latency", cpu_fraction=1.2):
    spec = tiny_spec(n_layers=n_layers, **SHAPE)
    wl = dataclasses.replace(WORKLOADS[workload], objective=objective)
    roomy = build_problem(spec, tiny_node(64, 64, **LINK), wl)
    total = sum(b.weight_bytes + b.kv_bytes for b in roomy.blocks)
    hw = tiny_node(64, 64, **LINK).with_budgets(
        gpu_mem=int(roomy.gpu_workspace_bytes + gpu_fraction * total),
        cpu_mem=int(roomy.cpu_workspace_bytes + cpu_fraction * total))
    return with_copies_held_back(build_problem(spec, hw, wl))


def test_a_dense_model_is_seen_as_identical_layers():
    shape = layered(_problem(3, 0.5, "short"))
    assert shape is not None
    assert shape.first.name == "embed" and shape.last.name == "head"
    assert [[b.name for b in layer] for layer in shape.layers] == [
        ["attn_0", "mlp_0"], ["attn_1", "mlp_1"], ["attn_2", "mlp_2"]]


def test_layers_that_cost_differently_are_not_counted():
    problem = _problem(3, 0.5, "short")
    stages = dict(problem.stages)
    stages["decode"] = tuple(dataclasses.replace(c, cpu_s=c.cpu_s * 2) if c.stage.block == "mlp_1" else c
                             for c in stages["decode"])
    assert layered(dataclasses.replace(problem, stages=stages)) is None


def _cross_checked(problem):
    """The count MILP's result, after checking that the per-block MILP finds the same optimum."""
    exact = dict(mip_rel_gap=1e-9, max_nodes=1_000_000)
    counted = ilp.solve(problem, ilp.IlpOptions(**exact))
    per_block = ilp.solve(problem, ilp.IlpOptions(**exact, count_layers=False))
    assert counted.status == per_block.status == "optimal"
    # both are optimal up to HiGHS's absolute gap of 1e-6 (ms, the models' time unit)
    assert counted.objective_s == pytest.approx(per_block.objective_s, rel=1e-7, abs=2e-9)
    return counted


@pytest.mark.parametrize("objective", ["latency", "ttft", "tpot"])
@pytest.mark.parametrize("gpu_fraction", [0.15, 0.35, 0.6, 0.85])
@pytest.mark.parametrize("workload", list(WORKLOADS))
@pytest.mark.parametrize("n_layers", [2, 4])
def test_count_milp_equals_the_per_block_milp(n_layers, workload, gpu_fraction, objective):
    problem = _problem(n_layers, gpu_fraction, workload, objective)
    counted = _cross_checked(problem)
    plan = make_plan(problem, counted.decision, {"strategy": "ilp", "status": "optimal"})
    assert fits(plan)
    sim = check_plan(plan)
    stated = {"ttft": plan.predicted["ttft_s"], "tpot": plan.predicted["tpot_s"],
              "latency": plan.predicted["latency_s"]}[objective]
    # the MILP's value bounds the replay with shared buses (conftest.MILP_REPLAY_REL_TOL) and is
    # exact for the timeline that gives every task its exclusive rate
    assert counted.objective_s * (1 - 1e-9) <= stated <= counted.objective_s * (1 + MILP_REPLAY_REL_TOL)
    exclusive = build_schedule(problem, counted.decision, shared_buses=False)
    t_alone = {"ttft": exclusive["prefill"].makespan_s, "tpot": exclusive["decode"].makespan_s,
               "latency": exclusive["prefill"].makespan_s + problem.workload.gen_len * exclusive["decode"].makespan_s}
    assert t_alone[objective] <= counted.objective_s * (1 + 1e-9)
    for phase in ("prefill", "decode"):
        assert sim.makespan_s[phase] == pytest.approx(plan.schedule[phase].makespan_s, rel=1e-9)


def test_a_tight_gpu_splits_layers_and_the_walk_visits_every_layer():
    problem = _problem(6, 0.4, "short")
    res = ilp.solve(problem, ilp.IlpOptions(mip_rel_gap=1e-9, max_nodes=1_000_000))
    dec = res.decision
    assert res.status == "optimal"
    assert set(dec.weights) == {b.name for b in problem.blocks}
    assert {"gpu"} < set(dec.weights.values())   # some resident, some not


def test_stray_cycles_are_found_and_cut():
    problem = _problem(4, 0.35, "short")
    model = LayerModel(problem, layered(problem), 1, 0.0, ilp.memory_unit(problem))
    O = len(model.layer_opts)
    o_path, o_cycle = 0, O - 1
    a_path, m_path = model._enter_leave(o_path)
    a_cycle, m_cycle = model._enter_leave(o_cycle)
    flows = {k: 0 for k in model.arcs}
    # the path: embed -> one layer in o_path -> head; a cycle of three layers in o_cycle
    flows["E", 0, "A", a_path] = 1
    flows["A", a_path, "O", o_path] = flows["O", o_path, "M", m_path] = 1
    flows["M", m_path, "H", 0] = 1
    flows["A", a_cycle, "O", o_cycle] = flows["O", o_cycle, "M", m_cycle] = 3
    flows["M", m_cycle, "A", a_cycle] = 3
    groups = model._stray_groups(flows)
    assert groups == [{("A", a_cycle), ("O", o_cycle), ("M", m_cycle)}]
    n_before = len(model.prob.constraints)
    model._add_cut(groups[0])
    assert len(model.prob.constraints) == n_before + 1
    # joined to the path, the same layers form one walk
    flows["M", m_cycle, "A", a_cycle] = 2
    flows["M", m_path, "H", 0] = 0
    flows["M", m_path, "A", a_cycle] = 1
    flows["M", m_cycle, "H", 0] = 1
    assert model._stray_groups(flows) == []
    assert model._walk(flows) == (0, [o_path, o_cycle, o_cycle, o_cycle], 0)


def _decision(problem, depth, attn_exec):
    names = [b.name for b in problem.blocks]
    weights = {n: "gpu" for n in names}
    weights.update(attn_0="cpu", mlp_0="stream")
    exec_ = {p: dict(weights) for p in ("prefill", "decode")}
    for p in exec_:
        exec_[p]["attn_0"] = attn_exec
    return Decision(weights, exec_, {b.name: "cpu" for b in problem.blocks if b.kind == "attn"}, depth=depth)


def test_a_load_is_issued_when_the_block_before_ends_or_starts():
    """Depth 1: after the block before ends. Depth 2: when the block before is ready to start,
    i.e. after the copy of its input (embed on the GPU, attn_0 on the CPU)."""
    problem = _problem(2, 0.5, "short")
    one = build_schedule(problem, _decision(problem, 1, "cpu"))["prefill"]
    assert ("attn_out/attn_0", "load/mlp_0") in one.edges
    two = build_schedule(problem, _decision(problem, 2, "cpu"))["prefill"]
    assert ("act_down/attn_in/attn_0", "load/mlp_0") in two.edges
    t = {x.id: x for x in two.tasks}
    assert t["load/mlp_0"].start_s == pytest.approx(t["attn_in/attn_0"].start_s)
    assert t["mlp/mlp_0"].start_s == pytest.approx(max(t["attn_out/attn_0"].end_s + t["act_up/mlp/mlp_0"].duration_s,
                                                        t["load/mlp_0"].end_s))


MOE = dict(arch="mixtral", hidden=1024, n_heads=8, n_kv_heads=4, head_dim=128, vocab=8000, intermediate=2048,
           n_experts=6, experts_per_token=2, moe_intermediate=2048)


@pytest.mark.parametrize("gpu_fraction", [0.2, 0.45, 0.7])
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_moe_layers_are_counted_with_their_expert_split(workload, gpu_fraction):
    spec = tiny_spec(n_layers=3, **MOE)
    wl = WORKLOADS[workload]
    roomy = build_problem(spec, tiny_node(64, 64, **LINK), wl)
    total = sum(b.weight_bytes + b.kv_bytes for b in roomy.blocks)
    hw = tiny_node(64, 64, **LINK).with_budgets(gpu_mem=int(roomy.gpu_workspace_bytes + gpu_fraction * total),
                                                cpu_mem=int(roomy.cpu_workspace_bytes + 1.2 * total))
    problem = with_copies_held_back(build_problem(spec, hw, wl))
    assert layered(problem) is not None
    counted = _cross_checked(problem)
    plan = make_plan(problem, counted.decision, {"strategy": "ilp", "status": "optimal"})
    assert fits(plan)
    assert plan.predicted["latency_s"] == pytest.approx(counted.objective_s, rel=1e-9)
    check_plan(plan)
