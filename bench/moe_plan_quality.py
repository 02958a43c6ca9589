"""Plan quality on the MoE scenarios: the expert-level ILP plan beside the llama.cpp-style baselines.

Scenarios, all with q4_k_m weights: Mixtral-8x7B on rtx4090-64g (24 GiB GPU), Qwen3-30B-A3B on
laptop-8g (8 GiB GPU), DeepSeek-V3 on epyc-4090-512g (24 GiB GPU + 512 GiB DDR5). For each:
predicted decode and prefill tokens/s of the ILP plan and of ``cpu-moe`` (every routed expert on
the CPU), the best fitting ``n-cpu-moe:N`` and the best fitting ``ngl:N`` (as
``hetplan.plan.compare.compare`` picks them: best on the workload's objective), each with the ratio
ILP / baseline (> 1 means the ILP plan is faster); "no fit" where a baseline does not fit in
memory. The summary gives the ILP's status, MIP gap and its GPU-resident routed experts (over
every MoE layer, of the model's total) and the best fitting faithful baseline (of those
``compare`` lists, ``hetplan.solvers.baselines.FAITHFUL``) with its ratio to the ILP on the
latency objective. The baselines follow llama.cpp as ``hetplan.solvers.baselines`` says (op
offload of DRAM-resident experts in prompts of 32+ tokens, token embeddings in DRAM).

    python bench/moe_plan_quality.py                              # batch 1, prompt 512, gen 128
    python bench/moe_plan_quality.py --only mixtral-8x7b --batch 4
    python bench/moe_plan_quality.py --only qwen3-30b-a3b --routing stats.json
"""

from __future__ import annotations

import argparse
import sys

from moe_compile_time import add_solver_args  # bench/moe_compile_time.py, beside this script

from hetplan.plan.compare import compare, ratio_to_chosen
from hetplan.solvers.baselines import FAITHFUL
from hetplan.compiler import CompileRequest, compile_plan
from hetplan.errors import HetplanError, InfeasibleError
from hetplan.plan.report import format_table

SCENARIOS = (("mixtral-8x7b", "rtx4090-64g"), ("qwen3-30b-a3b", "laptop-8g"),
             ("deepseek-v3", "epyc-4090-512g"))
"""(model, node), smallest GPU share of the model last."""
WEIGHT_DTYPE = "q4_k_m"
BASELINES = ("cpu-moe", "n-cpu-moe", "ngl")
"""Shown beside the ILP; ``n-cpu-moe`` and ``ngl`` at the N ``compare`` found best."""
DEFAULTS = CompileRequest(model="-", hw="-")


def experts_on_gpu(plan) -> tuple[int, int]:
    """(routed experts resident in HBM summed over MoE layers, routed experts in the model)."""
    moe = [p for p in plan.placement if p.get("experts_on_gpu") is not None]
    return sum(p["experts_on_gpu"] for p in moe), len(moe) * plan.model.n_experts


def baseline_rows(rows: list) -> list:
    """The Candidates of ``BASELINES`` out of ``compare``'s rows, in that order."""
    return [next(c for c in rows[1:] if c.strategy.partition(":")[0] == name) for name in BASELINES]


def rate_cells(ilp_plan, cand) -> list:
    """decode tok/s, ILP / it, prefill tok/s, ILP / it; "no fit" when ``cand`` does not fit."""
    if not cand.fits:
        return ["no fit", "-", "no fit", "-"]
    out = []
    for key in ("decode_tokens_per_s", "prefill_tokens_per_s"):
        mine, theirs = ilp_plan.predicted[key], cand.plan.predicted[key]
        out += [f"{theirs:.1f}", f"{mine / theirs:.2f}x"]
    return out


def scenario_rows(req: CompileRequest) -> tuple:
    name = f"{req.model} @ {req.hw}"
    try:
        plan, _ = compile_plan(req)
    except InfeasibleError as e:
        return [name, "infeasible", "-", "-", "-", "-", "-", "-"], [[name, "ilp", f"infeasible: {e}"]]
    rows = compare(plan, req)
    hot, total = experts_on_gpu(plan)
    p = plan.predicted
    faithful = [c for c in rows[1:] if c.fits and c.strategy.partition(":")[0] in FAITHFUL]
    best = min(faithful, key=lambda c: ratio_to_chosen(rows, c)) if faithful else None
    summary = [name, plan.solver["status"], f"{plan.solver['mip_gap']:.1e}", f"{hot}/{total}",
               f"{p['decode_tokens_per_s']:.1f}", f"{p['prefill_tokens_per_s']:.1f}",
               best.strategy if best else "none fits", f"{ratio_to_chosen(rows, best):.2f}x" if best else "-"]
    detail = [[name, "ilp", f"{p['decode_tokens_per_s']:.1f}", "1.00x", f"{p['prefill_tokens_per_s']:.1f}", "1.00x"]]
    for cand in baseline_rows(rows):
        detail.append([name, cand.strategy] + rate_cells(plan, cand))
    return summary, detail


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=DEFAULTS.batch)
    ap.add_argument("--prompt-len", type=int, default=DEFAULTS.prompt_len)
    ap.add_argument("--gen-len", type=int, default=DEFAULTS.gen_len)
    ap.add_argument("--routing", metavar="FILE", default=None,
                    help="routing statistics (hetplan exec --record-routing) of the one model chosen by --only")
    add_solver_args(ap)
    ap.add_argument("--only", action="append", metavar="MODEL", choices=[m for m, _ in SCENARIOS],
                    help="run only this model's scenario (repeatable)")
    args = ap.parse_args()
    scenarios = [(m, n) for m, n in SCENARIOS if not args.only or m in args.only]
    if args.routing and len(scenarios) != 1:
        ap.error("--routing: statistics belong to one model; pick its scenario with --only MODEL")
    print(f"# MoE plan quality: weights {WEIGHT_DTYPE}, batch {args.batch}, prompt {args.prompt_len}, "
          f"gen {args.gen_len}, objective latency, max_nodes {args.max_nodes}, mip_gap {args.mip_gap:g}"
          + (f", routing {args.routing}" if args.routing else ", uniform routing"))
    summaries, details = [], []
    for model, node in scenarios:
        req = CompileRequest(model=model, hw=node, weight_dtype=WEIGHT_DTYPE, batch=args.batch,
                             prompt_len=args.prompt_len, gen_len=args.gen_len, routing=args.routing,
                             max_nodes=args.max_nodes, mip_gap=args.mip_gap)
        try:
            summary, detail = scenario_rows(req)
        except HetplanError as e:
            sys.exit(f"error: {e}")
        summaries.append(summary)
        details += detail
        print(f"  {model}: done", file=sys.stderr, flush=True)
    print(format_table(["scenario", "ilp status", "gap", "experts on gpu", "decode tok/s", "prefill tok/s",
                        "best faithful baseline", "baseline / ilp (latency)"], summaries, right={2, 3, 4, 5, 7}))
    print()
    print(format_table(["scenario", "strategy", "decode tok/s", "ilp / this", "prefill tok/s", "ilp / this"],
                       details, right={2, 3, 4, 5}))


if __name__ == "__main__":
    main()
