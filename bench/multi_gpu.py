"""Several GPUs: the pipeline plan against the best single-GPU plan, predicted, with compile time.

    python bench/multi_gpu.py                  # llama-3.1-70b q4_k_m on 2x3090-128g
    python bench/multi_gpu.py --deepseek       # and deepseek-v3 q4_k_m on 8xh100 (slow: MoE stages)

For each case it compiles once on the multi-GPU node (``hetplan compile``'s library call: GPU 0's
plan and the pipeline beside it) and once on the same GPU in a one-GPU node where one exists
(rtx3090-128g: the card on PCIe 4.0 x16 rather than x8), and prints the predicted decode and
prefill rates of each, the pipeline's stages, and the wall and CPU seconds of each compile.
Predictions only: nothing here runs a model.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetplan.compiler import CompileRequest, compile_plan  # noqa: E402

CASES = [("llama-3.1-70b", "2x3090-128g", "rtx3090-128g"), ("deepseek-v3", "8xh100", None)]


def compile_case(model: str, hw: str):
    t0, c0 = time.perf_counter(), time.process_time()
    plan, _ = compile_plan(CompileRequest(model=model, hw=hw, weight_dtype="q4_k_m"))
    return plan, time.perf_counter() - t0, time.process_time() - c0


def row(label: str, pred: dict, wall: float, cpu: float) -> str:
    return (f"| {label} | {pred['ttft_s'] * 1e3:.1f} ms | {pred['tpot_s'] * 1e3:.2f} ms | "
            f"{pred['decode_tokens_per_s']:.2f} | {pred['prefill_tokens_per_s']:.1f} | {wall:.1f} s | {cpu:.1f} s |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deepseek", action="store_true", help="also deepseek-v3 on 8xh100")
    args = ap.parse_args()
    for model, multi, single in CASES[:2 if args.deepseek else 1]:
        print(f"\n{model} q4_k_m, batch 1, prompt 512, generate 128")
        print("| plan | TTFT | TPOT | decode tok/s | prefill tok/s | compile wall | compile CPU |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        plan, wall, cpu = compile_case(model, multi)
        if single is not None:
            one, w1, c1 = compile_case(model, single)
            print(row(f"{single} (one GPU, x16)", one.predicted, w1, c1))
        print(row(f"{multi}: GPU 0 alone", plan.predicted, wall, cpu))
        if plan.pipeline is None:
            print(f"| {multi}: no pipeline | | | | | | |")
            continue
        pp = plan.pipeline
        print(row(f"{multi}: pipeline over {len(pp['stages'])} GPUs (same compile)", pp["predicted"], wall, cpu))
        base = one.predicted if single is not None else plan.predicted
        p = pp["predicted"]
        print(f"pipeline / best single GPU: decode {p['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}x, "
              f"prefill {p['prefill_tokens_per_s'] / base['prefill_tokens_per_s']:.2f}x; with micro-batches "
              f"filling the stages {p['pipelined_decode_tokens_per_s']:.2f} tok/s")
        for s in pp["stages"]:
            w = s["weights"]
            print(f"  GPU {s['gpu']}: layers {s['layers'][0]}-{s['layers'][1] - 1}, blocks gpu/stream/cpu "
                  f"{w['gpu']}/{w['stream']}/{w['cpu']}, {s['gpu_bytes'] / 2**30:.2f} GiB on the GPU, "
                  f"TTFT {s['ttft_s'] * 1e3:.1f} ms, TPOT {s['tpot_s'] * 1e3:.2f} ms")
        for l in pp["links"]:
            print(f"  link {l['from_gpu']}->{l['to_gpu']} ({l['kind']}): prefill {l['prefill_s'] * 1e3:.3f} ms, "
                  f"decode {l['decode_s'] * 1e6:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
