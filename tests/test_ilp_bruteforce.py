"""The ILP is optimal: on one-layer models (4 blocks: embed, attn_0, mlp_0, head) every decision
is enumerated, replayed by the independent simulator, filtered by the memory budgets, and the
best objective found must be the ILP's.

Decision space enumerated here (restated, not imported from the solver):
  - each block's weights: ``gpu`` (executes on the GPU in both phases) or host-resident, then per
    phase ``cpu`` or ``stream`` (labelled ``stream`` iff some phase streams); the embedding never
    streams;
  - the attention block's KV cache: ``cpu``, or ``gpu`` when attention runs on the GPU in both phases;
  - staging depth 1 or 2.
Memory: a decision fits when what its plan reserves per tier (weights + KV + depth slots of the
largest streamed block + workspace) is within the budget; the replayed peak never exceeds it.
Objectives: latency = TTFT + gen_len * TPOT, ttft, tpot.
"""

import dataclasses
import itertools
import math

import pytest
from tests.conftest import tiny_node, tiny_spec

from tests.solver_model import placed_gpu_bytes, with_copies_held_back
from hetplan.compiler import CompileRequest, decide
from hetplan.evaluate import fits, make_plan
from hetplan.plan import Decision
from hetplan.problem import build_problem
from hetplan.plan.simulate import check_plan
from hetplan.workload import Workload

LAYER = dict(n_layers=1, hidden=4096, n_heads=32, n_kv_heads=8, head_dim=128, vocab=32000)
CASES = {
    # one llama-3-8b-sized layer, a short prompt, a PCIe-4-class link
    "short-prompt": (tiny_spec(**LAYER, intermediate=14336), Workload(batch=1, prompt_len=512, gen_len=128),
                     dict(h2d_bytes_per_s=16e9, d2h_bytes_per_s=16e9)),
    # a long batched prompt: prefill is compute-heavy, streaming pays, the workspace is large
    "long-prompt": (tiny_spec(**LAYER, intermediate=8192), Workload(batch=16, prompt_len=2048, gen_len=16),
                    dict(h2d_bytes_per_s=64e9, d2h_bytes_per_s=8e9)),
}
# (GPU, CPU) budgets as workspace + a fraction of all weights and KV, from roomy to infeasible;
# "barely-*" are exactly the memory of the decision on the Pareto front that uses the least of
# the GPU ("host") or of the CPU ("gpu").
BUDGETS = {
    "roomy": (1.5, 1.5), "gpu-three-quarters": (0.75, 1.0), "gpu-55pct": (0.55, 1.0),
    "gpu-quarter": (0.25, 1.0), "both-tight": (0.6, 0.5), "cpu-tight": (0.8, 0.3),
    "barely-host": None, "barely-gpu": None, "infeasible": (0.3, 0.3),
}
OBJECTIVE_S = {
    "latency": lambda ttft, tpot, wl: ttft + wl.gen_len * tpot,
    "ttft": lambda ttft, tpot, wl: ttft,
    "tpot": lambda ttft, tpot, wl: tpot,
}
_ONE_PHASE = {"gpu": ("gpu", "gpu", "gpu"), "cpu": ("cpu", "cpu", "cpu"),
              "stream-decode": ("stream", "cpu", "stream"), "stream-prefill": ("stream", "stream", "cpu"),
              "stream-both": ("stream", "stream", "stream")}
"""(weights, prefill exec, decode exec) of each way a block can run."""


def every_decision(blocks):
    attn = [b.name for b in blocks if b.kind == "attn"]
    ways = [[_ONE_PHASE["gpu"], _ONE_PHASE["cpu"]] if not b.streamable else list(_ONE_PHASE.values())
            for b in blocks]
    for combo in itertools.product(*ways):
        way = {b.name: w for b, w in zip(blocks, combo)}
        kv_ways = [("gpu", "cpu") if "cpu" not in way[a][1:] else ("cpu",) for a in attn]
        for kv in itertools.product(*kv_ways):
            for depth in (1, 2):
                yield Decision(weights={n: w[0] for n, w in way.items()},
                               exec={"prefill": {n: w[1] for n, w in way.items()},
                                     "decode": {n: w[2] for n, w in way.items()}},
                               kv=dict(zip(attn, kv)), depth=depth)


@dataclasses.dataclass(frozen=True)
class Evaluated:
    decision: Decision
    ttft_s: float
    tpot_s: float
    gpu_bytes: float
    cpu_bytes: float


_EVALUATED = {}


def evaluated(case: str) -> tuple:
    """Every decision of ``case``, replayed once on a roomy machine (times do not depend on budgets)."""
    if case not in _EVALUATED:
        spec, wl, links = CASES[case]
        problem = build_problem(spec, tiny_node(256, 256, **links), wl)
        out = []
        for dec in every_decision(problem.blocks):
            plan = make_plan(problem, dec, {"strategy": "enumerated"})
            sim = check_plan(plan)
            for tier in ("gpu", "cpu"):
                assert sim.peak_bytes[tier] <= plan.memory[f"{tier}_bytes"] * (1 + 1e-12)
            out.append(Evaluated(dec, sim.makespan_s["prefill"], sim.makespan_s["decode"],
                                 placed_gpu_bytes(plan), plan.memory["cpu_bytes"]))
        _EVALUATED[case] = (problem, tuple(out))
    return _EVALUATED[case]


def budgets_bytes(case: str, budget: str) -> tuple[int, int]:
    problem, rows = evaluated(case)
    if BUDGETS[budget] is not None:
        f_gpu, f_cpu = BUDGETS[budget]
        total = sum(b.weight_bytes + b.kv_bytes for b in problem.blocks)
        return (math.ceil(problem.gpu_workspace_bytes + f_gpu * total),
                math.ceil(problem.cpu_workspace_bytes + f_cpu * total))
    points = {(r.gpu_bytes, r.cpu_bytes) for r in rows}
    front = [p for p in points if not any(q[0] <= p[0] and q[1] <= p[1] and q != p for q in points)]
    g, c = min(front) if budget == "barely-host" else min(front, key=lambda p: (p[1], p[0]))
    return math.ceil(g), math.ceil(c)


@pytest.mark.parametrize("objective", list(OBJECTIVE_S))
@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("case", list(CASES))
def test_ilp_matches_the_best_enumerated_decision(case, budget, objective):
    _, rows = evaluated(case)
    spec, wl, links = CASES[case]
    wl = dataclasses.replace(wl, objective=objective)
    gpu_budget, cpu_budget = budgets_bytes(case, budget)
    hw = tiny_node(1, 1, **links).with_budgets(gpu_mem=gpu_budget, cpu_mem=cpu_budget)
    value = OBJECTIVE_S[objective]
    feasible = [r for r in rows if r.gpu_bytes <= gpu_budget and r.cpu_bytes <= cpu_budget]

    problem = with_copies_held_back(build_problem(spec, hw, wl))
    dec, info, _ = decide(problem, "ilp", None, CompileRequest(model=case, hw="tiny", objective=objective))
    if not feasible:
        assert budget == "infeasible"
        assert dec is None and info["status"] == "infeasible"
        return
    assert budget != "infeasible"
    assert dec is not None, f"the ILP found nothing, but {len(feasible)} decisions fit"
    plan = make_plan(problem, dec, info)
    assert fits(plan)
    check_plan(plan)
    best = min(value(r.ttft_s, r.tpot_s, wl) for r in feasible)
    got = value(plan.predicted["ttft_s"], plan.predicted["tpot_s"], wl)
    assert got >= best * (1 - 1e-6), "the ILP beat every decision that fits: its plan cannot be valid"
    assert got <= best * (1 + 1e-6 + info["mip_gap"]), (
        f"ILP {objective} {got:.9g} s > enumerated optimum {best:.9g} s ({(got - best) / best:.2e} worse)")
