"""Compile time of the ILP for every dense model preset up to 70B on every machine preset.

For each (model, node): the median wall time of ``compile_plan`` over --repeats runs (problem
building, MILP for every staging depth, plan assembly), the solver's status and MIP gap, and
whether the targets hold: median <= 2 s, status optimal, gap <= 1e-4.

    python bench/compile_time.py                     # full grid, 5 repeats
    python bench/compile_time.py --repeats 1 --nodes rtx4090-64g laptop-8g
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.errors import InfeasibleError
from hetplan.frontends.resolve import load_model
from hetplan.presets.models import MODEL_PRESETS
from hetplan.presets.nodes import NODE_PRESETS
from hetplan.plan.report import format_table

MAX_PARAMS = 73e9
"""Dense presets up to the 70B class (Llama-3.1-70B: 70.6e9 parameters, Qwen2.5-72B: 72.7e9)."""
TARGET_S, TARGET_GAP = 2.0, 1e-4


def dense_presets() -> list:
    specs = {name: load_model(name) for name in MODEL_PRESETS}
    return sorted((n for n, s in specs.items() if not s.is_moe and s.total_params() <= MAX_PARAMS),
                  key=lambda n: specs[n].total_params())


def median_compile(req: CompileRequest, repeats: int):
    """(median wall seconds of ``compile_plan(req)`` over ``repeats`` runs, the last plan), or
    None when the request is infeasible."""
    times, plan = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        try:
            plan, _ = compile_plan(req)
        except InfeasibleError:
            return None
        times.append(time.perf_counter() - t0)
    return statistics.median(times), plan


def measure(model: str, node: str, repeats: int, time_limit_s: float) -> list:
    timed = median_compile(CompileRequest(model=model, hw=node, time_limit_s=time_limit_s), repeats)
    if timed is None:
        return [model, node, "-", "infeasible", "-", "-", "-"]
    med, plan = timed
    status, gap = plan.solver["status"], plan.solver["mip_gap"]
    ok = med <= TARGET_S and status == "optimal" and gap <= TARGET_GAP
    return [model, node, f"{med:.3f}", status, f"{gap:.1e}", plan.model.weight_dtype, "yes" if ok else "NO"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--models", nargs="*", default=None, help="default: every dense preset up to 70B")
    ap.add_argument("--nodes", nargs="*", default=None, help="default: every node preset")
    ap.add_argument("--time-limit", type=float, default=60.0, help="ILP time limit per depth (s)")
    args = ap.parse_args()
    models, nodes = args.models or dense_presets(), args.nodes or sorted(NODE_PRESETS)
    print(f"# compile time: {len(models)} models x {len(nodes)} nodes, median of {args.repeats}, "
          f"{platform.processor() or platform.machine()}, python {platform.python_version()}")
    rows = []
    for model in models:
        for node in nodes:
            rows.append(measure(model, node, args.repeats, args.time_limit))
            print("  " + "  ".join(rows[-1]), file=sys.stderr, flush=True)
    print(format_table(["model", "node", "median s", "status", "gap", "dtype", "on target"], rows, right={2}))
    timed = [float(r[2]) for r in rows if r[2] != "-"]
    met = sum(r[-1] == "yes" for r in rows)
    print(f"\n{met}/{len(timed)} feasible scenarios on target (<= {TARGET_S} s, optimal, gap <= {TARGET_GAP}); "
          f"max {max(timed):.3f} s, median {statistics.median(timed):.3f} s; "
          f"{len(rows) - len(timed)} infeasible")


if __name__ == "__main__":
    main()
