"""Long contexts: Llama-3.1-8B bf16 on rtx4090-64g from a 12K prompt to a 131072-token context.

For each (prompt, batch): the prefill chunk the planner chose, predicted TTFT and TPOT, the GPU's
bytes split into weights / KV / workspace, where the KV caches live (layers with KV in HBM and
in DRAM), how many blocks compute on the GPU in prefill, and the compile time. Targets (issue
"Truthful plans, part 1"): GPU-using plans at prompt 32768 and at a 131072-token context, batch
1 and 4, KV split across tiers where it does not fit, TTFT growing roughly linearly in P (weight
bound part plus the attention term), never an all-CPU plan.

    python bench/long_context.py                 # the grid below
    python bench/long_context.py --prompt 65536 --batch 2
"""

from __future__ import annotations

import argparse
import time

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.plan.report import format_table
from hetplan.units import format_bytes

MODEL, NODE, GEN = "llama-3.1-8b", "rtx4090-64g", 128
GRID = [(12288, 1, None), (16384, 1, None), (32768, 1, None), (32768, 4, None), (12288, 16, None),
        (65536, 1, None), (131072 - GEN, 1, None), (131072 - GEN, 4, "q8_0")]
"""(prompt, batch, KV dtype): batch 4 at a 131072-token context holds 64 GiB of bf16 KV, which with
the weights leaves no room on a 23 + 60 GiB node (the compiler says so and suggests q8_0)."""


def row(prompt: int, batch: int, kv_dtype: str | None) -> list:
    t0 = time.perf_counter()
    plan, _ = compile_plan(CompileRequest(model=MODEL, hw=NODE, weight_dtype="bf16", prompt_len=prompt,
                                          gen_len=GEN, batch=batch, kv_dtype=kv_dtype))
    secs = time.perf_counter() - t0
    gpu = plan.memory["breakdown"]["gpu"]
    kv = [p["kv"] for p in plan.placement if p["kv"]]
    on_gpu = sum(1 for p in plan.placement if p["exec"]["prefill"] == "gpu")
    p = plan.predicted
    return [prompt, batch, plan.model.kv_dtype, plan.workload.chunk_len, f"{p['ttft_s']:.2f}", f"{p['tpot_s'] * 1e3:.1f}",
            format_bytes(gpu["weights"]), format_bytes(gpu["kv"]), format_bytes(gpu["workspace"]),
            f"{kv.count('gpu')} gpu / {kv.count('cpu')} cpu", f"{on_gpu}/{len(plan.placement)}",
            f"{p['ttft_s'] / prompt * 1e6:.1f}", f"{secs:.1f}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--kv-dtype", default=None)
    args = ap.parse_args()
    grid = [(args.prompt, args.batch, args.kv_dtype)] if args.prompt else GRID
    head = ["prompt", "batch", "KV dtype", "chunk", "TTFT s", "TPOT ms", "GPU weights", "GPU KV", "GPU workspace",
            "KV layers", "prefill blocks on GPU", "TTFT us/token", "compile s"]
    print(f"{MODEL} bf16 on {NODE}, generate {GEN}")
    print(format_table(head, [row(*g) for g in grid]))


if __name__ == "__main__":
    main()
