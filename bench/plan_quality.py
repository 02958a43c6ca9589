"""Plan quality on the golden scenarios: the ILP plan beside every baseline and the lower bound.

For each plan in plans/ (or the given files): predicted TTFT and TPOT of the ILP plan and of
each baseline (all-gpu, greedy, best ngl:N and ngl-nkvo:N, stream, flexgen; for MoE models
cpu-moe, best n-cpu-moe:N and ktransformers) on the same model, machine and workload; the ratio best fitting *faithful*
baseline / ILP on the scenario's objective (>= 1 means the ILP wins; faithful: the baselines that
reproduce a tool, ``hetplan.solvers.baselines.FAITHFUL``, so not ``stream``); and how far the
ILP plan is from the placement-independent lower bound (plan / bound, per phase). The detail
table says which tool version each baseline follows.

    python bench/plan_quality.py                  # plans/*.json as checked in
    python bench/plan_quality.py --recompile      # recompile each scenario's ILP plan first
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hetplan.plan.check import plan_paths, request_of
from hetplan.plan.compare import compare, follows, ratio_to_chosen
from hetplan.solvers.baselines import FAITHFUL, FOLLOWS
from hetplan.compiler import compile_plan
from hetplan.plan import load_plan
from hetplan.plan.report import format_table
from hetplan.units import format_seconds

PLANS = Path(__file__).resolve().parent.parent / "plans"


def scenario_rows(path: Path, recompile: bool) -> tuple:
    plan = load_plan(path)
    req = request_of(plan, str(path))
    if recompile:
        plan, _ = compile_plan(req)
    rows = compare(plan, req)
    name = path.stem
    detail = []
    for c in rows:
        p, r = c.plan.predicted, ratio_to_chosen(rows, c)
        detail.append([name, c.strategy, format_seconds(p["ttft_s"]), format_seconds(p["tpot_s"]),
                       "no fit" if r is None else f"{r:.2f}x", "-" if c.chosen else follows(c.strategy).split(" ")[0]])
    fitting = [c for c in rows[1:] if c.fits and c.strategy.partition(":")[0] in FAITHFUL]
    best = min(fitting, key=lambda c: ratio_to_chosen(rows, c)) if fitting else None
    p = plan.predicted
    summary = [name, plan.workload.objective, plan.solver["status"], format_seconds(p["ttft_s"]),
               format_seconds(p["tpot_s"]), best.strategy if best else "none fits",
               f"{ratio_to_chosen(rows, best):.2f}x" if best else "-",
               f"{p['ttft_s'] / p['lower_bound_ttft_s']:.2f}x", f"{p['tpot_s'] / p['lower_bound_tpot_s']:.2f}x"]
    return summary, detail


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plans", nargs="*", default=[str(PLANS)])
    ap.add_argument("--recompile", action="store_true", help="solve each scenario's ILP again first")
    args = ap.parse_args()
    summaries, details = [], []
    for path in plan_paths(args.plans):
        summary, detail = scenario_rows(path, args.recompile)
        summaries.append(summary)
        details += detail
    print(format_table(["scenario", "objective", "ilp status", "ilp TTFT", "ilp TPOT", "best faithful baseline",
                        "baseline / ilp", "TTFT / bound", "TPOT / bound"], summaries, right={3, 4, 6, 7, 8}))
    print()
    print(format_table(["scenario", "strategy", "TTFT", "TPOT", "x ilp (objective)", "follows"], details,
                       right={2, 3, 4}))
    print()
    for tool in sorted({v for v in FOLLOWS.values() if v != "-"}):
        print(f"follows: {tool}")


if __name__ == "__main__":
    main()
