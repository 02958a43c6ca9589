"""Tests that compare formulations hold back HBM for copies to the host, as the problem's input.

The solvers place weights, KV, staging slots and workspace within ``Problem.gpu_budget_bytes``.
A plan also holds what its copies to the host leave waiting (``memory.breakdown.gpu.copies_out``,
``hetplan.plan.pending``), which follows from the schedule and no formulation sees; compile
solves again with that much held back while a plan overflows (``Problem.held_back``).

A test that compares formulations with each other or with brute force gives the node
``copies_bound`` more HBM and holds exactly that back (``with_copies_held_back``): the solvers'
budget, and so the set of decisions that fit it, is the test's own, and every plan made from
one of them fits the node with its copies counted, so ``fits`` and ``check_plan`` hold as
written. Brute force compares with the solvers' model: a decision fits when its bytes without
the copies (``placed_gpu_bytes``) are within the solvers' budget.
"""

from __future__ import annotations

import dataclasses
import math

from hetplan.graph import PHASES


def copies_bound(problem) -> float:
    """Bytes copies to the host could hold at once under any decision, the larger phase: every
    stage's input (each may be copied down before a CPU stage), every MoE block's rows sent to
    the CPU with all its experts cold, and in prefill every attention block's prompt K/V rows in
    the activation dtype (fp32 models: 4 bytes, else 2)."""
    spec, wl = problem.model, problem.workload
    e = 4 if spec.weight_dtype == "fp32" else 2
    kv_rows = wl.batch * wl.prompt_len * spec.kv_elems_per_token() * e
    out = 0.0
    for phase in PHASES:
        total = sum(sc.stage.in_bytes for sc in problem.stages[phase])
        total += sum(x.down_bytes(0) for x in problem.experts.get(phase, {}).values())
        if phase == "prefill":
            total += kv_rows * sum(1 for b in problem.blocks if b.kind == "attn")
        out = max(out, total)
    return out


def with_copies_held_back(problem):
    """``problem`` on a node with ``copies_bound`` more HBM, all of it held back from the
    solvers: their budget is unchanged."""
    held = math.ceil(copies_bound(problem))
    hw = problem.hw.with_budgets(gpu_mem=int(problem.gpu_budget_bytes + held))
    return dataclasses.replace(problem, hw=hw, gpu_budget_bytes=float(hw.gpu_budget_bytes()) - held,
                               gpu_held_back_bytes=held)


def placed_gpu_bytes(plan) -> float:
    """The plan's GPU bytes as the solvers count them: without the copies to the host."""
    return plan.memory["gpu_bytes"] - plan.memory["breakdown"]["gpu"]["copies_out"]
