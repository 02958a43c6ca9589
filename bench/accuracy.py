"""Does the measured cost model predict real runs? Profile this machine, compile plans for three
Llama-architecture sizes (about 0.1 B, 0.5 B and 1.5 B parameters, random weights) at batch 1
and 8, execute them, and print predicted vs measured TTFT and TPOT side by side.

    python bench/accuracy.py                      # CPU: all-CPU plans (targets: median |err| <= 10 %, max <= 20 %)
    python bench/accuracy.py --gpu-mem-frac 0.4   # GPU: mixed plans under a capped --gpu-mem (median <= 15 %)

Every step is the ``hetplan`` command line, printed before it runs, so a row can be reproduced
by hand. ``--node`` reuses an existing profile instead of measuring again; ``--calibrate`` then
folds each plan's traced run back into the profile (``hetplan profile --from-trace``),
recompiles and runs again, to show predictions improving with use. Exits 1 when off target.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = {
    # name: (hidden, intermediate, layers, heads, kv heads); vocab 32000, untied head.
    "llama-0.1b": (768, 2048, 12, 12, 4),
    "llama-0.5b": (1024, 4096, 24, 16, 4),
    "llama-1.5b": (2048, 8192, 22, 32, 8),
}


def config(name: str, dtype: str) -> dict:
    d, f, n, h, kv = MODELS[name]
    return {"model_type": "llama", "_name_or_path": name, "hidden_size": d, "intermediate_size": f,
            "num_hidden_layers": n, "num_attention_heads": h, "num_key_value_heads": kv, "vocab_size": 32000,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "torch_dtype": {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]}


def params(name: str) -> float:
    d, f, n, h, kv = MODELS[name]
    hd = d // h
    return n * (d * (2 * d + 2 * kv * hd) + 3 * d * f + 2 * d) + 2 * 32000 * d + d


def hetplan(*args: str, capture: bool = False, threads: int | None = None) -> str:
    cmd = [sys.executable, "-m", "hetplan", *args]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads)) if threads else None
    prefix = f"OMP_NUM_THREADS={threads} " if threads else ""
    print(f"$ {prefix}hetplan " + " ".join(shlex.quote(a) for a in args), flush=True)
    res = subprocess.run(cmd, text=True, stdout=subprocess.PIPE if capture else None, env=env)
    if res.returncode:
        raise SystemExit(f"hetplan {args[0]} failed (exit {res.returncode})")
    return res.stdout or ""


def err(pred: float, meas: float) -> float:
    """Signed relative error of the prediction: (predicted - measured) / measured."""
    return (pred - meas) / meas


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "hetplan-accuracy"),
                    help="Directory for configs, node.yaml, plans.")
    ap.add_argument("--node", default=None, help="Use this node.yaml instead of profiling now.")
    ap.add_argument("--budget", default="240s", help="Profile budget.")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                    help="Weight dtype (fp32 on CPUs, where torch's 16-bit GEMVs are slow; bf16 on GPUs).")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=8)
    ap.add_argument("--gpu-mem-frac", type=float, default=None,
                    help="GPU runs: cap --gpu-mem at this fraction of the model's weights (mixed plans).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="Runs per plan; measured = their median.")
    ap.add_argument("--calibrate", action="store_true",
                    help="Then fold each plan's traced first run into the profile, recompile and run again.")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for profile and exec (OMP_NUM_THREADS); default: torch's choice.")
    a = ap.parse_args()

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    names = a.models.split(",")
    dirs = {}
    for name in names:
        dirs[name] = work / name
        dirs[name].mkdir(exist_ok=True)
        (dirs[name] / "config.json").write_text(json.dumps(config(name, a.dtype), indent=1))
    node = a.node
    if node is None:
        node = str(work / "node.yaml")
        t0 = time.perf_counter()
        hetplan("profile", "--out", node, "--budget", a.budget, *[x for n in names for x in ("--model", str(dirs[n]))],
                threads=a.threads)
        print(f"profiled in {time.perf_counter() - t0:.1f} s", flush=True)

    plans = {}
    for name in names:
        for batch in (int(b) for b in a.batches.split(",")):
            plans[name, batch] = work / f"{name}-b{batch}.json"
            compile_plan(a, dirs[name], node, batch, plans[name, batch])
    ok = report("predicted from the profile", [run_plan(a, k, plans[k], trace=a.calibrate) for k in plans],
                a.gpu_mem_frac is not None)
    if a.calibrate:
        profile = Path(node).with_name(Path(node).stem + ".profile.json")
        for k, plan in plans.items():
            hetplan("profile", "--from-trace", str(plan.with_suffix(".trace.json")), "--profile", str(profile),
                    "--plan", str(plan))
        for (name, batch), plan in plans.items():
            compile_plan(a, dirs[name], node, batch, plan)
        report("predicted after folding each plan's first run back in (--from-trace)",
               [run_plan(a, k, plans[k], trace=False) for k in plans], a.gpu_mem_frac is not None)
    return 0 if ok else 1


def compile_plan(a, model_dir: Path, node: str, batch: int, plan: Path) -> None:
    extra = []
    if a.gpu_mem_frac is not None:
        gpu_mem = int(params(model_dir.name) * {"fp32": 4, "bf16": 2, "fp16": 2}[a.dtype] * a.gpu_mem_frac)
        extra = ["--gpu-mem", str(gpu_mem)]
    hetplan("compile", str(model_dir), "--hw", node, "--batch", str(batch), "--prompt-len", str(a.prompt_len),
            "--gen-len", str(a.gen_len), "--weight-dtype", a.dtype, "-o", str(plan), *extra)


def run_plan(a, key: tuple, plan: Path, trace: bool) -> tuple:
    """Execute ``plan`` ``a.repeats`` times (the first with a trace when asked) -> one table row,
    measured = the median over the runs."""
    runs = []
    for i in range(a.repeats):
        extra = ["--trace", str(plan.with_suffix(".trace.json"))] if trace and i == 0 else []
        runs.append(json.loads(hetplan("exec", str(plan), "--weights", "random", "--seed", str(a.seed), "--json",
                                       *extra, capture=True, threads=a.threads)))
    placement = json.loads(plan.read_text())["placement"]
    mix = sorted({p["weights"] for p in placement} | {f"kv:{p['kv']}" for p in placement if p["kv"]})
    p = runs[0]["predicted"]
    m = {k: statistics.median(r["measured"][k] for r in runs) for k in ("ttft_s", "tpot_s")}
    return key + (p["ttft_s"], m["ttft_s"], p["tpot_s"], m["tpot_s"], "+".join(mix))


def report(title: str, rows: list, gpu: bool) -> bool:
    """Print predicted vs measured side by side and the error summary; True when on target."""
    print(f"\n{title}:")
    print(f"{'model':<12} {'batch':>5} {'TTFT pred':>10} {'TTFT meas':>10} {'err':>7} "
          f"{'TPOT pred':>10} {'TPOT meas':>10} {'err':>7}  placement")
    errors = []
    for name, batch, pt, mt, pd, md, mix in rows:
        e1, e2 = err(pt, mt), err(pd, md)
        errors += [abs(e1), abs(e2)]
        print(f"{name:<12} {batch:>5} {pt * 1e3:>8.1f}ms {mt * 1e3:>8.1f}ms {e1:>+7.1%} "
              f"{pd * 1e3:>8.2f}ms {md * 1e3:>8.2f}ms {e2:>+7.1%}  {mix}")
    med, worst = statistics.median(errors), max(errors)
    target = "median <= 15 %" if gpu else "median <= 10 %, max <= 20 %"
    ok = med <= 0.15 if gpu else (med <= 0.10 and worst <= 0.20)
    print(f"|error| over {len(errors)} predictions: median {med:.1%}, max {worst:.1%} "
          f"(target {target}: {'met' if ok else 'NOT met'})", flush=True)
    return ok


if __name__ == "__main__":
    sys.exit(main())
