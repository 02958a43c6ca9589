"""The ``--compare`` table: a compiled plan beside every baseline strategy on the same problem.

Rebuilds the problem the plan was solved on from the plan itself (its model with the chosen
weight dtype, its hardware with the budgets it was given, its workload with the batch it
chose), runs each baseline through ``hetplan.compiler.decide`` and prices the result with the
same plan builder. Knows nothing about how a strategy decides.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetplan import progress
from hetplan.compiler import COUNTED, CompileRequest, decide
from hetplan.evaluate import fits, make_plan
from hetplan.plan import Plan
from hetplan.problem import Problem, build_problem

BASELINE_ORDER = ("all-gpu", "greedy", "ngl", "ngl-nkvo", "stream", "flexgen")
"""Baselines listed by ``--compare``; ``ngl`` and ``ngl-nkvo`` are shown at their best layer count,
``flexgen`` at the largest GPU weight percent that fits."""
MOE_BASELINE_ORDER = ("cpu-moe", "n-cpu-moe", "ktransformers")
"""Listed besides for MoE models; ``n-cpu-moe`` at its best layer count."""


@dataclass(frozen=True)
class Candidate:
    strategy: str
    """Strategy name as ``--strategy`` spells it (``ngl:N`` with the N used)."""
    plan: Plan
    missing_bytes: dict
    """tier -> bytes over that tier's budget; empty when the plan fits."""
    chosen: bool = False

    @property
    def fits(self) -> bool:
        return not self.missing_bytes


def missing_bytes(plan: Plan) -> dict:
    """tier -> used - budget, for each tier over its budget."""
    m = plan.memory
    return {t: m[f"{t}_bytes"] - m[f"{t}_budget_bytes"] for t in ("gpu", "cpu")
            if m[f"{t}_bytes"] > m[f"{t}_budget_bytes"] * (1 + 1e-9)}


def score(plan: Plan) -> float:
    """What the workload's objective ranks by, lower is better: seconds for latency, TTFT and
    TPOT; seconds per generated token (1 / throughput) for throughput."""
    if plan.workload.objective == "throughput":
        return 1.0 / plan.predicted["throughput_tokens_per_s"]
    return plan.solver["objective_s"]


def _baseline(problem: Problem, strategy: str, arg: int | None, req: CompileRequest) -> Candidate:
    dec, info, _ = decide(problem, strategy, arg, req)
    plan = make_plan(problem, dec, info)
    return Candidate(info["strategy"], plan, missing_bytes(plan))


def best_count(problem: Problem, req: CompileRequest, name: str = "ngl") -> Candidate:
    """``ngl:N`` or ``ngl-nkvo:N`` (N in 0..n_layers+1) or ``n-cpu-moe:N`` (N in 0..n_layers)
    with the best objective among those that fit (when none fits, the last tried: ngl with every
    layer, n-cpu-moe with every layer's experts in DRAM)."""
    top = problem.model.n_layers + (1 if name == "n-cpu-moe" else 2)
    counts = range(top)
    best = None
    for n in counts:
        cand = _baseline(problem, name, n, req)
        if cand.fits and (best is None or score(cand.plan) < score(best.plan)):
            best = cand
    return best or _baseline(problem, name, counts[-1], req)


def compare(plan: Plan, req: CompileRequest) -> list:
    """The chosen plan first, then each baseline of ``BASELINE_ORDER`` (and for MoE models
    ``MOE_BASELINE_ORDER``) on the plan's problem."""
    from hetplan.routing import routing_of_plan

    names = BASELINE_ORDER + (MOE_BASELINE_ORDER if plan.model.is_moe else ())
    with progress.step(f"comparing with {len(names)} baselines"):
        problem = build_problem(plan.model, plan.hardware, plan.workload, routing=routing_of_plan(plan))
        rows = [Candidate(plan.solver["strategy"], plan, {} if fits(plan) else missing_bytes(plan), chosen=True)]
        for i, name in enumerate(names):
            progress.activity(f"{i + 1}/{len(names)} {name}")
            rows.append(best_count(problem, req, name) if name in COUNTED and name != "flexgen"
                        else _baseline(problem, name, None, req))
    return rows


def ratio_to_chosen(rows: list, cand: Candidate) -> float | None:
    """How many times worse than the chosen plan ``cand`` is on the objective (1.0 = as good);
    None when ``cand`` does not fit in memory (its times could not be had)."""
    return score(cand.plan) / score(rows[0].plan) if cand.fits else None


def follows(strategy: str) -> str:
    """The tool and version a baseline strategy follows (``-`` for the chosen strategy's own)."""
    from hetplan.solvers.baselines import FOLLOWS
    return FOLLOWS.get(strategy.partition(":")[0], "-")


def compare_dicts(rows: list) -> list:
    """Rows as JSON-ready dicts (for ``compile --json --compare``)."""
    out = []
    for c in rows:
        p = c.plan.predicted
        out.append({"strategy": c.strategy, "chosen": c.chosen, "fits": c.fits,
                    "missing_bytes": c.missing_bytes, "ttft_s": p["ttft_s"], "tpot_s": p["tpot_s"],
                    "decode_tokens_per_s": p["decode_tokens_per_s"],
                    "throughput_tokens_per_s": p["throughput_tokens_per_s"],
                    "gpu_bytes": c.plan.memory["gpu_bytes"], "cpu_bytes": c.plan.memory["cpu_bytes"],
                    "ratio_to_chosen": ratio_to_chosen(rows, c),
                    "follows": "-" if c.chosen else follows(c.strategy)})
    return out
