"""Compile time of the expert-level MoE ILP on the MoE scenarios, all with q4_k_m weights.

Rows: DeepSeek-V3 and Qwen3-235B-A22B on epyc-4090-512g (RTX 4090 24 GiB + 512 GiB DDR5), the
target scenarios; Mixtral-8x7B on rtx4090-64g and Qwen3-30B-A3B on laptop-8g besides. For each:
the median wall time of ``compile_plan`` over --repeats runs (problem building, the MILP for
every staging depth, plan assembly), the solver's status and MIP gap, the binary and integer
variables of the MILP (``plan.solver["size"]["binaries"]`` counts both), and whether the target
holds: median <= 10 s, status optimal, gap <= 1e-3.

    python bench/moe_compile_time.py                          # every row, 5 repeats
    python bench/moe_compile_time.py --repeats 1 --only deepseek-v3 --max-nodes 100
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

from compile_time import median_compile  # bench/compile_time.py, beside this script

from hetplan.compiler import CompileRequest
from hetplan.plan.report import format_table

SCENARIOS = (("deepseek-v3", "epyc-4090-512g"), ("qwen3-235b-a22b", "epyc-4090-512g"),
             ("mixtral-8x7b", "rtx4090-64g"), ("qwen3-30b-a3b", "laptop-8g"))
"""(model, node): the two target scenarios first, then the extra rows."""
WEIGHT_DTYPE = "q4_k_m"
TARGET_S, TARGET_GAP = 10.0, 1e-3
DEFAULTS = CompileRequest(model="-", hw="-")
"""The library's defaults for the options passed through (max_nodes, mip_gap, time_limit_s)."""


def measure(model: str, node: str, args: argparse.Namespace) -> list:
    req = CompileRequest(model=model, hw=node, weight_dtype=WEIGHT_DTYPE, max_nodes=args.max_nodes,
                         mip_gap=args.mip_gap, time_limit_s=args.time_limit)
    timed = median_compile(req, args.repeats)
    if timed is None:
        return [model, node, "-", "infeasible", "-", "-", "-"]
    med, plan = timed
    status, gap = plan.solver["status"], plan.solver["mip_gap"]
    ok = med <= TARGET_S and status == "optimal" and gap <= TARGET_GAP
    return [model, node, f"{med:.2f}", status, f"{gap:.1e}", plan.solver["size"]["binaries"],
            "yes" if ok else "NO"]


def add_solver_args(ap: argparse.ArgumentParser) -> None:
    """--max-nodes and --mip-gap, defaulting to the library's values (shared by the MoE benches)."""
    ap.add_argument("--max-nodes", type=int, default=DEFAULTS.max_nodes,
                    help="branch-and-bound nodes per MILP solved (default %(default)s)")
    ap.add_argument("--mip-gap", type=float, default=DEFAULTS.mip_gap,
                    help="relative gap at which the MILP stops (default %(default)s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    add_solver_args(ap)
    ap.add_argument("--time-limit", type=float, default=DEFAULTS.time_limit_s,
                    help="ILP time limit per MILP solved, s (default %(default)s)")
    ap.add_argument("--only", action="append", metavar="NAME", choices=[m for m, _ in SCENARIOS],
                    help="run only this model's row (repeatable)")
    args = ap.parse_args()
    scenarios = [(m, n) for m, n in SCENARIOS if not args.only or m in args.only]
    print(f"# MoE compile time: {len(scenarios)} scenarios, weights {WEIGHT_DTYPE}, median of {args.repeats}, "
          f"max_nodes {args.max_nodes}, mip_gap {args.mip_gap:g}, time limit {args.time_limit:g} s; "
          f"{platform.platform()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}")
    rows = []
    for model, node in scenarios:
        rows.append(measure(model, node, args))
        print("  " + "  ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    print(format_table(["model", "node", "median s", "status", "gap", "binaries+integers", "on target"],
                       rows, right={2, 4, 5}))
    met = sum(r[-1] == "yes" for r in rows)
    print(f"\n{met}/{len(rows)} on target (<= {TARGET_S:g} s, optimal, gap <= {TARGET_GAP:g})")


if __name__ == "__main__":
    main()
