"""A plan's TTFT against a run, with the profile's own kernels timed again beside the run.

    python bench/profile_vs_run.py --work /root/.cache/hetplan-bench/exec_cpu \\
        --profile WORK/profile/node.yaml [--dtype fp32] [--rounds 5]

On a shared host (a VM whose vCPUs share physical cores with other tenants) the speed of
compute moves by a fifth from one minute to the next, and a plan priced from a profile taken
earlier misses a run by as much. This bench tells the two apart. The model is
``bench/exec_cpu.py``'s (WORK/model: 0.85 B parameters, 16 layers; ``model-bf16`` for bf16), the
plan all-CPU for prompt 64 (``compile_plan`` with the node.yaml ``hetplan profile`` wrote). Each
round, in this one process (2 threads):

1. *now*: the plan's prefill stages timed with the profiler's own kernels
   (``hetplan.runtime.profiler.kernels.stage_kernels``: the runtime's backend on random weights,
   each call reading its weights cold; ``time_call``: two warm-up calls, then the median), at
   the rows the prefill runs them (64 for embed, attn_in, attn_out, mlp; prefill attention over
   64; the head over the last position), summed as the plan's all-CPU chain sums them: every
   layer's stages, the embedding and the head, each plus the runtime's per-task overhead the
   profile measured. What ``hetplan profile`` would price the plan at, measured now.
2. *run*: ``run_plan`` (what ``hetplan exec`` does): warm TTFT of the prompt.

The two are taken in turn, *now* first in odd rounds and the run first in even ones.

Printed per round: the plan's prediction (the profile's table, measured earlier), *now*, the
run, run / now and run / prediction; and the same sum over the profile's own table (it must
equal the plan's prediction: the check that *now* is the sum the plan makes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

PROMPT, THREADS = 64, 2
SHARE_S = 1.0
"""Seconds each stage's kernel is repeated for, per round (its median taken)."""
CHAIN = ("attn_in", "attention_prefill", "attn_out", "mlp")
"""The stages of one layer in a prefill, in order (``attention_prefill`` is ``attn_core``)."""


def rows(op: str) -> float:
    """The profile's x of a stage of the prompt's prefill: rows, or ``p (p + 1) / 2`` for causal
    prefill attention, or one row for the head (the last position's logits)."""
    return {"attention_prefill": PROMPT * (PROMPT + 1) / 2, "head": 1.0}.get(op, float(PROMPT))


def kernels(spec) -> dict:
    """op -> the profiler's kernel of that stage of the prompt's prefill."""
    from hetplan.runtime.profiler.kernels import stage_kernels

    want = set(CHAIN) | {"embed", "head"}
    return {k.op: k for k in stage_kernels(spec, "cpu") if k.op in want and k.x == rows(k.op)}


def chain_s(per_op: dict, n_layers: int, overhead_s: float) -> float:
    """The all-CPU prefill chain: embed, every layer's stages, head, each a task."""
    tasks = [per_op["embed"]] + [per_op[op] for op in CHAIN] * n_layers + [per_op["head"]]
    return sum(tasks) + overhead_s * len(tasks)


def from_table(profile_json: Path, spec) -> tuple:
    """(op -> the profile's seconds at the prefill's x, the per-task overhead it measured)."""
    from hetplan.profile.table import load_profile, shape_key

    table = load_profile(profile_json)
    out = {}
    for op in set(CHAIN) | {"embed", "head"}:
        entry = table.entries.get(("cpu", op, spec.weight_dtype, shape_key(op, spec)))
        point = next((p for p in entry.points if p.x == rows(op)), None) if entry else None
        if point is not None:
            out[op] = point.seconds
    return out, table.info["task_overhead_s"]["cpu"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/root/.cache/hetplan-bench/exec_cpu"))
    ap.add_argument("--profile", type=Path, required=True, help="the node.yaml `hetplan profile` wrote")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    import torch
    torch.set_num_threads(THREADS)
    from hetplan.compiler import CompileRequest, compile_plan
    from hetplan.frontends.resolve import load_model
    from hetplan.runtime.profiler.measure import time_call
    from hetplan.runtime.session import RunOptions, run_plan

    ckpt = args.work / ("model-bf16" if args.dtype == "bf16" else "model")
    spec = load_model(str(ckpt)).with_dtypes(weight_dtype=args.dtype)
    plan, _ = compile_plan(CompileRequest(model=str(ckpt), hw=str(args.profile), weight_dtype=args.dtype,
                                          prompt_len=PROMPT, gen_len=2))
    table, overhead = from_table(args.profile.parent / "node.profile.json", spec)
    missing = (set(CHAIN) | {"embed", "head"}) - set(table)
    if missing:
        print(f"the profile has no {sorted(missing)} at the prefill's rows for {args.dtype}: profile with "
              f"--model {ckpt}", file=sys.stderr)
        return 2
    predicted, summed = plan.predicted["ttft_s"], chain_s(table, spec.n_layers, overhead)
    print(f"{args.dtype}, prompt {PROMPT}: plan's TTFT {predicted * 1e3:.1f} ms; the profile's table summed as "
          f"the chain: {summed * 1e3:.1f} ms")
    ks, caches = kernels(spec), {}
    ids = (tuple(range(3, 3 + PROMPT)),)
    print("| round | predicted | now (profile's kernels) | run | run / now | run / predicted |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    ratios = {"now": [], "predicted": []}
    def timed_now() -> float:
        per_op = {op: time_call(k.setup(caches.setdefault(k.group, {})), lambda: None, SHARE_S).median_s
                  for op, k in ks.items()}
        return chain_s(per_op, spec.n_layers, overhead)

    def timed_run() -> float:
        return run_plan(plan, RunOptions(weights=str(ckpt), prompt_ids=ids, gen_len=2)).measured["ttft_s"]

    for r in range(1, args.rounds + 1):   # the two in turn, first one then the other
        if r % 2:
            now, run = timed_now(), timed_run()
        else:
            run, now = timed_run(), timed_now()
        ratios["now"].append(run / now)
        ratios["predicted"].append(run / predicted)
        print(f"| {r} | {predicted * 1e3:.0f} ms | {now * 1e3:.0f} ms | {run * 1e3:.0f} ms | {run / now:.2f} | "
              f"{run / predicted:.2f} |", flush=True)
        time.sleep(1.0)
    print(f"median run / now {statistics.median(ratios['now']):.2f}, run / predicted "
          f"{statistics.median(ratios['predicted']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
