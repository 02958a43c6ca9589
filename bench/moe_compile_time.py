"""Compile time of the MoE ILP with skewed, per-layer-different routing profiles, q4_k_m weights.

Rows: every MoE preset (Mixtral-8x7B, Qwen3-30B-A3B, Qwen3-235B-A22B, DeepSeek-V3) with a
profile from ``hetplan.routing_gen`` (Zipf skew 1.0, seed 0) on every node preset where it fits;
then ``--objective throughput --batch 64``, ``--stream-cold-experts``, and DeepSeek-V3 on
rtx4090-64g with 512 GiB of DRAM (a node.yaml: the preset with its memory raised; uniform and
skewed). For each: wall and CPU seconds of the
whole ``compile_plan`` (inputs, problem building, LP bounds, every MILP, plan assembly), the
solver's status and MIP gap, what solved it (``milp``, ``chain-dp``: ``solvers/ilp/chain/``,
or both), and whether the target holds (<= 10 s wall,
<= 5 s for the DeepSeek rtx4090 rows; status optimal, gap <= 1e-3).

    python bench/moe_compile_time.py                       # every row
    python bench/moe_compile_time.py --only mixtral-8x7b --time-limit 30
    python bench/moe_compile_time.py --match throughput --match 512GiB
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import hetplan.frontends  # noqa: F401  (presets resolve through the frontends)
from hetplan.compiler import CompileRequest, compile_plan
from hetplan.errors import InfeasibleError
from hetplan.plan.report import format_table
from hetplan.presets.models import model_preset
from hetplan.presets.nodes import NODE_PRESETS
from hetplan.routing import write_routing
from hetplan.routing_gen import skewed_profile

MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3")
WEIGHT_DTYPE = "q4_k_m"
TARGET_S, TARGET_GAP = 10.0, 1e-3
DEFAULTS = CompileRequest(model="-", hw="-")
"""The library's defaults for the options passed through (max_nodes, mip_gap, time_limit_s)."""


def scenarios(profiles: dict, big_host: str) -> list:
    """(label, CompileRequest fields, target seconds) of every row."""
    rows = [(f"{m} @ {n}", dict(model=m, hw=n, routing=profiles[m]), TARGET_S)
            for m in MODELS for n in NODE_PRESETS]
    rows += [(f"{m} @ {n} throughput b64", dict(model=m, hw=n, routing=profiles[m], objective="throughput", batch=64),
              TARGET_S) for m, n in (("mixtral-8x7b", "rtx4090-64g"), ("qwen3-30b-a3b", "laptop-8g"))]
    rows += [(f"{m} @ {n} stream-cold", dict(model=m, hw=n, routing=profiles[m], stream_cold_experts=True), TARGET_S)
             for m, n in (("mixtral-8x7b", "rtx4090-64g"), ("qwen3-30b-a3b", "laptop-8g"))]
    rows += [(f"deepseek-v3 @ rtx4090-64g 512GiB {kind}",
              dict(model="deepseek-v3", hw=big_host, routing=profiles["deepseek-v3"] if kind == "skewed" else None),
              5.0) for kind in ("uniform", "skewed")]
    return rows


def rtx4090_512g(folder: Path) -> str:
    """The rtx4090-64g preset with 512 GiB of DRAM, as a node.yaml (``--cpu-mem`` may no longer
    exceed what the node has)."""
    text = NODE_PRESETS["rtx4090-64g"].replace("memory: 64GiB", "memory: 512GiB")
    text = text.replace("name: rtx4090-64g", "name: rtx4090-512g")
    assert "512GiB" in text
    path = folder / "rtx4090-512g.yaml"
    path.write_text(text)
    return str(path)


def measure(label: str, fields: dict, target_s: float, args) -> list:
    req = CompileRequest(weight_dtype=WEIGHT_DTYPE, max_nodes=args.max_nodes, mip_gap=args.mip_gap,
                         time_limit_s=args.time_limit, **fields)
    t0 = time.perf_counter()
    try:
        plan, took = compile_plan(req)
    except InfeasibleError:
        return [label, f"{time.perf_counter() - t0:.2f}", "-", "does not fit", "-", "-", "-"]
    status, gap = plan.solver["status"], plan.solver["mip_gap"]
    ok = took.wall_s <= target_s and status == "optimal" and gap <= TARGET_GAP
    return [label, f"{took.wall_s:.2f}", f"{took.cpu_s:.2f}", status, f"{gap:.1e}",
            plan.solver.get("formulation", "milp"), "yes" if ok else "NO"]


def add_solver_args(ap: argparse.ArgumentParser) -> None:
    """--max-nodes and --mip-gap, defaulting to the library's values (shared by the MoE benches)."""
    ap.add_argument("--max-nodes", type=int, default=DEFAULTS.max_nodes,
                    help="branch-and-bound nodes per MILP solved (default %(default)s)")
    ap.add_argument("--mip-gap", type=float, default=DEFAULTS.mip_gap,
                    help="relative gap at which the MILP stops (default %(default)s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_solver_args(ap)
    ap.add_argument("--time-limit", type=float, default=DEFAULTS.time_limit_s,
                    help="ILP time limit per MILP solved, s (default %(default)s)")
    ap.add_argument("--only", action="append", metavar="MODEL", choices=MODELS)
    ap.add_argument("--match", action="append", metavar="TEXT",
                    help="only the rows whose label contains TEXT (repeatable)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hetplan-routing-"))
    profiles = {}
    for m in MODELS:
        profiles[m] = str(tmp / f"{m}.json")
        write_routing(profiles[m], skewed_profile(model_preset(m), 1.0, 0))
    rows_in = [r for r in scenarios(profiles, rtx4090_512g(tmp)) if (not args.only or r[1]["model"] in args.only)
               and (not args.match or any(m in r[0] for m in args.match))]
    print(f"# MoE compile time, skewed profiles (Zipf 1.0, seed 0): {len(rows_in)} rows, weights {WEIGHT_DTYPE}, "
          f"max_nodes {args.max_nodes}, mip_gap {args.mip_gap:g}, time limit {args.time_limit:g} s per MILP; "
          f"{platform.platform()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}")
    rows = []
    for label, fields, target in rows_in:
        rows.append(measure(label, fields, target, args))
        print("  " + "  ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    print(format_table(["scenario", "wall s", "CPU s", "status", "gap", "solved by", "on target"], rows,
                       right={1, 2, 4, 5}))
    fit = [r for r in rows if r[3] != "does not fit"]
    met = sum(r[-1] == "yes" for r in fit)
    print(f"\n{met}/{len(fit)} fitting rows on target (<= {TARGET_S:g} s, <= 5 s for DeepSeek on rtx4090-64g; "
          f"optimal, gap <= {TARGET_GAP:g})")


if __name__ == "__main__":
    main()
